"""Device-correct by construction, checked on a CPU-only machine: every tiny model preset, every precision recipe and
every expert and permutation back end that runs on the CPU is built under ``with torch.device("fakegpu")`` and
trained for a step (forward, backward, AdamW, expert-bias update) on that device, which is not the CPU, so that a
tensor created on the CPU by default (a ``torch.Generator()`` drawing under a device context, a constant built
without a device) and meeting the model's tensors fails here as it would on a GPU. Each run must also match the same
run on the CPU: the harness computes for real.

The device (:func:`on_device`): torch's PrivateUse1 backend renamed ``fakegpu`` (device guard, hooks and device
module the Python stand-ins of ``torch.utils.backend_registration``), whose tensors (:class:`OnDevice`) are wrapper
subclasses holding real CPU data. A dispatch mode runs every op on the CPU data and checks the devices first, with
CUDA's rules: tensors of one device, or CPU 0-dim tensors (scalars) and CPU indices; copies between devices; a
generator of the output's device. The renaming holds for the rest of the process (torch allows one name), which
is why the nox integration session runs this module in a process of its own: transformers' loading and DCP's writer
behave differently once a backend is registered (NaN logits, a stream query the stand-in cannot answer).

Not "cuda" itself: a ``device="cuda"`` argument initialises CUDA and indexing takes CUDA's device guard, both of which
need a driver. Not fake CUDA tensors (FakeTensorMode) either: they hold no data (the expert counts' ``.tolist()``, the
amax checks fail) and do not check a generator's device; nor the meta device, on which ``reset_parameters`` returns
at once. So code behind ``is_cuda`` (the triton permutation picked by ``auto``, ``torch.cuda`` calls) is not reached:
the backend tests name triton.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.utils import backend_registration
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing
from torch.utils._pytree import tree_flatten, tree_map

from moe_models import build_model, causal_lm_loss
from moe_models.presets import TINY_PRESETS, preset
from moe_precision import PrecisionConfig
from moe_precision.blockwise import random_hadamard_transform
from moe_precision.recipes import RECIPES
from moe_train.adamw import PrecisionAwareAdamW
from moe_train.precision import apply_run_precision

DEVICE_TYPE = "fakegpu"  # a torch.device only once registered (on_device)
CPU = torch.device("cpu")
aten = torch.ops.aten
# ops whose tensors may be on different devices, on CUDA as here: the output is the first tensor's (copy_) or the
# device asked for (_to_copy)
_CROSS_DEVICE = {aten.copy_.default, aten._to_copy.default, aten._foreach_copy_.default}
# advanced indexing moves CPU indices to the indexed tensor's device
_CPU_INDICES_OK = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


class _BackendModule(backend_registration._DummyBackendModule):
    """``torch.fakegpu``: what autocast asks a backend module for, on top of the stand-in's device queries. Available
    only while this module's tests run: the registration outlives them (one name per process), and later tests of
    the process must not find a device that is not there (DCP's file writer, seeing one, asks it for streams)."""

    available = False

    def is_available(self) -> bool:
        return _BackendModule.available

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def _device_available() -> Iterator[None]:
    _BackendModule.available = True
    try:
        yield
    finally:
        _BackendModule.available = False


def _register_device() -> None:
    """Rename PrivateUse1 to ``fakegpu`` once per process (torch allows one name per process)."""
    name = torch._C._get_privateuse1_backend_name()
    if name == DEVICE_TYPE:
        return
    if name != "privateuseone":
        pytest.skip(f"PrivateUse1 is already the {name!r} backend in this process")
    backend_registration._setup_privateuseone_for_python_backend(DEVICE_TYPE, backend_module=_BackendModule())


class OnDevice(torch.Tensor):
    """A tensor on ``fakegpu:0`` whose data is the CPU tensor ``elem``."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> OnDevice:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=torch.device(DEVICE_TYPE, 0),
            requires_grad=elem.requires_grad,
        )

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    def __repr__(self) -> str:  # type: ignore[override]
        return f"OnDevice({self.elem!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # tolist refuses tensor subclasses before any dispatch; on a GPU it copies to the host, as here
        if func is torch.Tensor.tolist:
            return args[0].elem.tolist()
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return _run(func, args, kwargs or {})


def _is_device(d: object) -> bool:
    """Whether ``d`` (a device, a device string, or anything else an op takes) names DEVICE_TYPE."""
    return isinstance(d, torch.device | str) and str(d).split(":")[0] == DEVICE_TYPE


def _check_devices(func, args, kwargs) -> torch.device | None:  # type: ignore[no-untyped-def]
    """The one device of the op's tensors (None: CPU scalars alone or none), raising CUDA's error on two."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if func in _CPU_INDICES_OK:
        indices = [i for i in args[1] if i is not None]
        tensors = [t for t in tensors if not any(t is i for i in indices)]
    common: torch.device | None = None
    for t in tensors:
        device = t.device  # an OnDevice tensor's: fakegpu:0
        if device.type == "cpu" and t.dim() == 0:
            continue
        if common is None:
            common = device
        elif device != common:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, {common} and "
                f"{device}! ({func})"
            )
    return common


def _run(func, args, kwargs):  # type: ignore[no-untyped-def]
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if func in _CROSS_DEVICE:
        out_device = tensors[0].device
    else:
        out_device = _check_devices(func, args, kwargs) or next(
            (t.device for t in tensors if isinstance(t, OnDevice)), CPU
        )
    if kwargs.get("device") is not None:
        out_device = torch.device(kwargs["device"])
    generator = kwargs.get("generator")
    if generator is not None and generator.device.type != out_device.type:
        raise RuntimeError(
            f"Expected a '{out_device.type}' device type for generator but found '{generator.device.type}'"
        )

    def to_cpu(a: object) -> object:
        if isinstance(a, OnDevice):
            return a.elem
        return CPU if isinstance(a, torch.device) and _is_device(a) else a

    cpu_args, cpu_kwargs = tree_map(to_cpu, args), tree_map(to_cpu, kwargs)
    if _is_device(cpu_kwargs.get("device")):
        cpu_kwargs["device"] = CPU
    out = func(*cpu_args, **cpu_kwargs)
    if out_device.type == DEVICE_TYPE:
        out = tree_map(lambda t: OnDevice(t) if type(t) is torch.Tensor else t, out)
    # in-place ops return their (wrapper) input, views share its storage
    return return_and_correct_aliasing(func, args, kwargs, out)


class _Mode(TorchDispatchMode):
    """Routes factory ops (a ``device`` of DEVICE_TYPE, no tensor inputs) and everything else through :func:`_run`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return _run(func, args, kwargs or {})


@contextmanager
def _from_data_through_run() -> Iterator[None]:
    """``torch.tensor(data, device=...)`` and kin copy their CPU tensor to the device with the dispatch modes off;
    here they copy it through :func:`_run`. A patch, not a TorchFunctionMode: neither such modes nor FakeTensorMode's
    thread-local ``_set_only_lift_cpu_tensors`` reach an autograd.Function's backward on the device's thread."""
    originals = {name: getattr(torch, name) for name in ("tensor", "as_tensor", "asarray")}

    def through_run(make):  # type: ignore[no-untyped-def]
        @functools.wraps(make)
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            if _is_device(kwargs.get("device")):
                return make(*args, **{**kwargs, "device": CPU}).to(kwargs["device"])
            return make(*args, **kwargs)

        return wrapper

    for name, make in originals.items():
        setattr(torch, name, through_run(make))
    try:
        yield
    finally:
        for name, make in originals.items():
            setattr(torch, name, make)


@contextmanager
def on_device() -> Iterator[torch.device]:
    """Inside: the device ``fakegpu:0`` (yielded) exists and every op checks its tensors' devices."""
    _register_device()
    with _from_data_through_run(), _Mode():
        yield torch.device(DEVICE_TYPE, 0)


# ---------------------------------------------------------------- the harness catches what a GPU would


def test_a_cpu_tensor_meeting_a_device_tensor_raises_as_on_a_gpu():
    with on_device() as device:
        x = torch.ones(4, 3, device=device)
        assert x.device == device and (x * torch.tensor(2.0)).device == device  # a CPU scalar is fine
        assert (x[torch.tensor([0, 2])]).shape == (2, 3)  # so are CPU indices
        with pytest.raises(RuntimeError, match="two devices"):
            x + torch.ones(3)
        with pytest.raises(RuntimeError, match="two devices"):
            x @ torch.ones(3, 2)
        assert torch.equal(x.cpu(), torch.ones(4, 3)) and x.sum().item() == 12.0 and x.tolist()[0] == [1.0] * 3
        assert torch.tensor([1.0, 2.0], device=device).device == device


def test_a_cpu_generator_drawing_under_a_device_context_raises_as_on_a_gpu():
    with on_device() as device, torch.device(device):
        with pytest.raises(RuntimeError, match="Expected a 'fakegpu' device type for generator but found 'cpu'"):
            torch.randn(3, generator=torch.Generator().manual_seed(0))
        x = torch.randn(3, generator=torch.Generator().manual_seed(0), device="cpu")  # the CPU spelled out
        assert x.device == CPU


def test_hadamard_transform_stays_on_the_operands_device():
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(0))
    signs = torch.where(torch.arange(16) % 3 == 0, -1.0, 1.0)
    with on_device() as device:
        y = random_hadamard_transform(x.to(device), signs.to(device))
        assert y.device == device
        y = y.cpu()
    torch.testing.assert_close(y, random_hadamard_transform(x, signs), rtol=0, atol=0)


# ---------------------------------------------------------------- models, recipes and back ends on the device

SEQ = 32


def _step(cfg, device: torch.device, recipe: str = "none", steps: int = 1) -> tuple[list[float], dict]:
    """Build under ``with torch.device(device)`` (seed 0), apply ``recipe`` (emulated), and train ``steps`` steps
    (forward, backward, AdamW): the losses, and the first step's gradients on the CPU."""
    with torch.device(device):
        model = build_model(cfg, seed=0)
    if recipe != "none":
        assert apply_run_precision(model, PrecisionConfig(recipe, emulate=True), cfg.num_layers, native=False) > 0
    optimizer = PrecisionAwareAdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses, grads = [], {}
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (2, SEQ + 1), generator=gen).to(device)
        out = model(ids[:, :-1])
        assert out.logits.device == device
        loss = causal_lm_loss(out, ids[:, 1:], cfg.mtp_loss_scaling_factor).total
        loss.backward()
        if not grads:
            grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
            assert grads and all(g.device == device for g in grads.values())
            grads = {name: g.cpu() for name, g in grads.items()}
        optimizer.step()
        optimizer.zero_grad()
        if cfg.moe_router_enable_expert_bias:  # as the train loop, after the optimizer step
            for router, counts_E in zip(model.routers(), out.tokens_per_expert_LE, strict=True):
                router.update_expert_bias(counts_E)
        losses.append(loss.item())
    return losses, grads


def _same_as_on_the_cpu(cfg, recipe: str = "none", steps: int = 1) -> None:
    torch.manual_seed(0)  # nvfp4's stochastic rounding draws from the global generator (the CPU's, on both runs)
    with on_device() as device:
        losses, grads = _step(cfg, device, recipe, steps)
    torch.manual_seed(0)
    # the same seeds on the CPU: the harness runs the real ops, and the initial values do not depend on the device
    # (a gradient sum's order may: not bit for bit)
    cpu_losses, cpu_grads = _step(cfg, CPU, recipe, steps)
    assert losses == pytest.approx(cpu_losses, rel=1e-5)
    torch.testing.assert_close(grads, cpu_grads)


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_preset_builds_and_trains_on_a_device(name):
    _same_as_on_the_cpu(preset(name, moe_expert_backend="torch", moe_permute_backend="torch"))


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "none"])
def test_recipe_trains_on_a_device(recipe):
    # two steps: fp8_delayed's second step scales from the history the first recorded; nvfp4's weight gradients
    # take the Hadamard transform
    cfg = preset("tiny-qwen3-moe", num_layers=1, moe_expert_backend="torch", moe_permute_backend="torch")
    _same_as_on_the_cpu(cfg, recipe, steps=2)


@pytest.mark.parametrize("permute", ["torch", "triton"])
@pytest.mark.parametrize("experts", ["torch", "loop"])
def test_backend_trains_on_a_device(experts, permute):
    if permute == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("the triton permutation backend asks for the triton package, not installed here")
    # capacity with padding: the dropped and padding rows' paths too
    cfg = preset(
        "tiny-mixtral",
        num_layers=1,
        moe_expert_backend=experts,
        moe_permute_backend=permute,
        moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True,
    )
    _same_as_on_the_cpu(cfg)
