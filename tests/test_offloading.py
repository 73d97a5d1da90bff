"""Fitting big models on one chip: ``.data`` across devices and every offloading feature of the HF stack.

Each offloaded run is compared with the same model fully on tpu (outputs equal, float32: same programs on the
same values) or, where offloading changes the arithmetic (float8 layerwise casting, VAE tiling), with the same
feature on the CPU. Group offloading with streams is tested with the streams themselves (test_streams.py).
"""

from __future__ import annotations

import gc

import pytest
import torch
from test_diffusers_pipelines import build, diffusers, generate, one_block_vae, tiny_unet

from conftest import assert_same


def test_data_moves_a_parameter_between_cpu_and_tpu_keeping_it():
    param = torch.nn.Parameter(torch.randn(3))
    calls = []
    param.register_hook(lambda grad: calls.append("hook") or grad)
    param.register_post_accumulate_grad_hook(lambda tensor: calls.append("accumulated"))
    param.note = "kept"
    (param * 2).sum().backward()
    identity = id(param)

    param.data = param.data.to("tpu")

    assert id(param) == identity and type(param) is torch.nn.Parameter and param.note == "kept"
    assert param.device.type == "tpu" and param.requires_grad and param.is_leaf
    assert param.grad.device.type == "tpu"  # the gradient moves along
    (param * 3).sum().backward()
    assert calls == ["hook", "accumulated"] * 2
    torch.testing.assert_close(param.grad.cpu(), torch.full((3,), 5.0))

    param.data = param.data.to("cpu", torch.float16)
    assert param.device.type == "cpu" and param.dtype == torch.float16 and param.grad.dtype == torch.float16


def test_data_between_devices_keeps_tied_weights_tied_and_shares_the_new_storage():
    embedding, head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False)
    head.weight = embedding.weight
    moved = embedding.weight.data.to("tpu")
    embedding.weight.data = moved
    assert head.weight is embedding.weight and head.weight.device.type == "tpu"
    assert embedding.weight.data_ptr() == moved.data_ptr()
    plain = torch.ones(2)
    plain.data = torch.zeros(3, device="tpu")
    assert_same(plain, torch.zeros(3))


def test_data_refuses_to_move_a_tensor_a_live_graph_holds():
    param = torch.nn.Parameter(torch.randn(3, device="tpu"))
    loss = (param * param).sum()
    with pytest.raises(RuntimeError, match="autograd graph still uses this tensor.*torch.no_grad"):
        param.data = param.data.cpu()
    assert param.device.type == "tpu"
    loss.backward()
    del loss
    gc.collect()
    param.data = param.data.cpu()
    assert param.device.type == "cpu" and param.grad.device.type == "cpu"


def test_data_refuses_non_leaf_tensors_across_devices():
    result = torch.randn(2, requires_grad=True) * 2
    with pytest.raises(RuntimeError, match="non-leaf"):
        result.data = torch.zeros(2, device="tpu")


def test_data_still_traces_under_torch_compile():
    compiled = torch.compile(lambda x: x.data * 2, backend="tpu", fullgraph=True)
    assert_same(compiled(torch.ones(2, device="tpu")), torch.full((2,), 2.0))


# diffusers ---------------------------------------------------------------------------------------------------


def _unet_inputs(device: str):
    generator = torch.Generator().manual_seed(0)
    sample, text = torch.randn(1, 4, 32, 32, generator=generator), torch.randn(1, 7, 32, generator=generator)
    return sample.to(device), torch.tensor([10]).to(device), text.to(device)


def _run_unet(unet, device: str = "tpu") -> torch.Tensor:
    with torch.no_grad():
        return unet(*_unet_inputs(device)).sample


@pytest.fixture(scope="module")
def unet_weights():
    torch.manual_seed(0)
    return tiny_unet().state_dict()


@pytest.fixture(scope="module")
def unet_on_tpu_output(unet_weights):
    return _run_unet(_unet(unet_weights).to("tpu")).cpu()


def _unet(weights) -> diffusers.UNet2DConditionModel:
    unet = tiny_unet()
    unet.load_state_dict(weights)
    return unet.eval()


@pytest.mark.parametrize("options", [
    dict(offload_type="block_level", num_blocks_per_group=1),
    dict(offload_type="block_level", num_blocks_per_group=2, low_cpu_mem_usage=True),
    dict(offload_type="leaf_level"),
    dict(offload_type="leaf_level", low_cpu_mem_usage=True),
], ids=["block", "block-low-cpu-mem", "leaf", "leaf-low-cpu-mem"])
def test_group_offloading_matches_the_model_on_tpu(unet_weights, unet_on_tpu_output, options):
    unet = _unet(unet_weights)
    unet.enable_group_offload(onload_device=torch.device("tpu"), **options)
    output = _run_unet(unet)
    assert output.device.type == "tpu"
    torch.testing.assert_close(output.cpu(), unet_on_tpu_output, rtol=0, atol=0)
    assert all(p.device.type == "cpu" for p in unet.parameters())  # offloaded again after the forward


def test_group_offloading_to_disk_matches_the_model_on_tpu(unet_weights, unet_on_tpu_output, tmp_path):
    unet = _unet(unet_weights)
    unet.enable_group_offload(onload_device=torch.device("tpu"), offload_type="leaf_level",
                              offload_to_disk_path=str(tmp_path))
    torch.testing.assert_close(_run_unet(unet).cpu(), unet_on_tpu_output, rtol=0, atol=0)
    assert list(tmp_path.glob("*.safetensors"))


@pytest.mark.parametrize("storage_dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_layerwise_casting_inference_matches_cpu(unet_weights, storage_dtype):
    outputs = {}
    for device in ("cpu", "tpu"):
        unet = _unet(unet_weights).to(device)
        unet.enable_layerwise_casting(storage_dtype=storage_dtype, compute_dtype=torch.float32)
        assert unet.conv_in.weight.dtype == storage_dtype  # stored narrow between forwards
        outputs[device] = _run_unet(unet, device)
    assert_same(outputs["tpu"], outputs["cpu"], rtol=1e-4, atol=1e-4)


def test_layerwise_casting_training_computes_with_the_stored_weights(unet_weights):
    """Weights stored in float8 between forward and backward: the gradients are those of float32 training on the
    float8-rounded weights (CPU's reference, without casting hooks). CPU itself cannot run this: layerwise casting
    re-casts the weights with ``.data`` after the forward, and CPU's convolution backward then refuses the float8
    weight it saved ("expected scalar type Float but found Float8_e4m3fn"); tpu computes with the stored values."""
    unet = _unet(unet_weights).to("tpu")
    unet.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    rounded = {name: value.cpu().float() for name, value in unet.state_dict().items()}
    loss = unet(*_unet_inputs("tpu")).sample.square().mean()
    loss.backward()

    reference = _unet(rounded)
    expected_loss = reference(*_unet_inputs("cpu")).sample.square().mean()
    expected_loss.backward()
    assert_same(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for (name, actual), expected in zip(unet.named_parameters(), reference.parameters()):
        assert actual.grad is not None, name
        assert_same(actual.grad, expected.grad, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def stable_diffusion_images():
    return generate(build("stable_diffusion").to("tpu"), "stable_diffusion").cpu()


@pytest.mark.parametrize("offload", ["enable_model_cpu_offload", "enable_sequential_cpu_offload"])
def test_pipeline_cpu_offload_matches_the_pipeline_on_tpu(stable_diffusion_images, offload):
    pipe = build("stable_diffusion")
    getattr(pipe, offload)(device="tpu")
    images = generate(pipe, "stable_diffusion")
    assert images.device.type == "tpu"
    torch.testing.assert_close(images.cpu(), stable_diffusion_images, rtol=0, atol=0)
    assert pipe.unet.conv_in.weight.device.type in ("cpu", "meta")  # nothing kept on the chip between calls


def test_vae_tiling_and_slicing_match_cpu():
    torch.manual_seed(0)
    weights = one_block_vae(latent_channels=4).state_dict()
    images = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(0))
    outputs = {}
    for device in ("cpu", "tpu"):
        vae = one_block_vae(latent_channels=4)
        vae.load_state_dict(weights)
        vae.to(device).enable_tiling()
        vae.tile_sample_min_size, vae.tile_latent_min_size = 32, 32  # 48x48 images: 2x2 overlapping tiles
        vae.enable_slicing()
        with torch.no_grad():
            latents = vae.encode(images.to(device)).latent_dist.mean
            outputs[device] = (latents, vae.decode(latents).sample)
    assert_same(outputs["tpu"], outputs["cpu"], rtol=1e-4, atol=1e-4)


# transformers and accelerate ---------------------------------------------------------------------------------

IDS = torch.tensor([[2, 5, 6, 7, 8, 9]])


@pytest.fixture(scope="module")
def llama_on_tpu(llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu")
    with torch.no_grad():
        logits = model(IDS.to("tpu")).logits.cpu()
    return logits, model.generate(IDS.to("tpu"), max_new_tokens=5, do_sample=False).cpu()


def _assert_like_the_model_on_tpu(model, llama_on_tpu) -> None:
    logits, tokens = llama_on_tpu
    with torch.no_grad():
        actual = model(IDS.to("tpu")).logits
    assert actual.device.type == "tpu"
    torch.testing.assert_close(actual.cpu(), logits, rtol=0, atol=0)
    assert torch.equal(model.generate(IDS.to("tpu"), max_new_tokens=5, do_sample=False).cpu(), tokens)


LAYERS = {"model.embed_tokens": "tpu", "model.rotary_emb": "tpu", "model.norm": "tpu", "lm_head": "tpu"}


@pytest.mark.parametrize("second_layer", ["cpu", "disk"])
def test_device_map_with_cpu_and_disk_entries(llama_dir, llama_on_tpu, tmp_path, second_layer):
    from transformers import AutoModelForCausalLM

    device_map = {**LAYERS, "model.layers.0": "tpu", "model.layers.1": second_layer}
    model = AutoModelForCausalLM.from_pretrained(llama_dir, device_map=device_map, offload_folder=tmp_path)
    assert model.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # loaded at each forward
    _assert_like_the_model_on_tpu(model, llama_on_tpu)


def test_max_memory_plans_what_the_chip_holds(llama_dir, llama_on_tpu):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, device_map="auto",
                                                 max_memory={0: "200KB", "cpu": "1GB"})
    assert model.hf_device_map["model.embed_tokens"] == 0 and model.hf_device_map["model.layers"] == "cpu"
    assert model.model.embed_tokens.weight.device == torch.device("tpu", 0)
    _assert_like_the_model_on_tpu(model, llama_on_tpu)


@pytest.mark.parametrize("offload", ["cpu_offload", "disk_offload"])
def test_accelerate_offload_functions(llama_dir, llama_on_tpu, tmp_path, offload):
    import accelerate
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    if offload == "cpu_offload":
        accelerate.cpu_offload(model, execution_device=torch.device("tpu"))
    else:
        accelerate.disk_offload(model, str(tmp_path), execution_device=torch.device("tpu"))
    _assert_like_the_model_on_tpu(model, llama_on_tpu)


def test_safetensors_reads_straight_to_tpu(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    tensors = {"a": torch.randn(3, 4), "b": torch.arange(6)}
    save_file(tensors, tmp_path / "w.safetensors")
    loaded = load_file(tmp_path / "w.safetensors", device="tpu")
    for name, tensor in tensors.items():
        assert_same(loaded[name], tensor)
    with safe_open(tmp_path / "w.safetensors", framework="pt", device="tpu:0") as handle:
        assert sorted(handle.keys()) == ["a", "b"]
        assert_same(handle.get_slice("a")[1:, :2], tensors["a"][1:, :2])
    assert load_file(tmp_path / "w.safetensors", device="cpu")["a"].device.type == "cpu"
