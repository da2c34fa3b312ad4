"""moe_train.safe_dcp: DCP checkpoints load bit for bit without unpickling anything but DCP's metadata types; a
tampered ``.metadata`` (code to run, pickled-bytes entries, data files outside the directory) and damaged data
files (missing, truncated) are one-line errors naming the file, and the tampering never runs."""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from moe_models import build_model
from moe_models.presets import preset
from moe_train.adamw import PrecisionAwareAdamW
from moe_train.checkpoint import save_checkpoint
from moe_train.safe_dcp import (
    ALLOWED_GLOBALS,
    DamagedCheckpointError,
    RestrictedUnpickler,
    SafeFileSystemReader,
    UnsafeCheckpointError,
    read_metadata,
)

DATA_FILE = "__0_0.distcp"


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(4, 8, generator=gen).to(torch.bfloat16),
        "b": torch.randn(8, generator=gen),
        "ids": torch.arange(-3, 9, dtype=torch.int64),
        "scale": torch.tensor(0.1234567),  # 0-d
        "f8": torch.randn(3, 5, generator=gen).to(torch.float8_e4m3fn),
        "flag": torch.tensor([True, False, True]),
    }


def _zeros_like_stored(metadata: Metadata) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(md.size, dtype=md.properties.dtype) for k, md in metadata.state_dict_metadata.items()}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _rewrite(checkpoint: Path, change) -> None:
    """Rewrite ``checkpoint``'s ``.metadata`` after ``change(metadata)`` (read the trusted way: we wrote it)."""
    metadata = read_metadata(checkpoint)
    change(metadata)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))


def _load_error(checkpoint: Path) -> str:
    """What ``dcp.load`` through the safe reader fails with (DCP wraps a reader's errors)."""
    state = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in _tensors().items()}
    with pytest.raises((CheckpointException, AssertionError, ValueError)) as err:
        dcp.load(state, storage_reader=SafeFileSystemReader(checkpoint))
    return str(err.value)


def _globals_named(metadata_file: Path) -> set[tuple[str, str]]:
    seen: set[tuple[str, str]] = set()

    class Recording(RestrictedUnpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    with open(metadata_file, "rb") as f:
        Recording(f).load()
    return seen


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A DCP checkpoint of :func:`_tensors`, one process."""
    path = tmp_path / "ckpt"
    dcp.save(_tensors(), checkpoint_id=path)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A checkpoint written by moe_train.checkpoint.save_checkpoint: a bf16 tiny MoE, bf16 AdamW state with fp32
    masters, after one update."""
    model = build_model(preset("tiny-qwen3-moe", num_layers=1), seed=3).to(torch.bfloat16)
    optimizer = PrecisionAwareAdamW(model.parameters(), lr=1e-2, states_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=gen).to(param.dtype)
    optimizer.step()
    return save_checkpoint(tmp_path_factory.mktemp("run"), model, optimizer, step=7), model


# ----------------------------------------------------------------------------- real checkpoints load


def test_a_save_checkpoint_checkpoint_loads_bit_for_bit(trained: tuple[Path, torch.nn.Module]) -> None:
    path, model = trained
    metadata = read_metadata(path)
    safe, stock = _zeros_like_stored(metadata), _zeros_like_stored(metadata)
    dcp.load(safe, storage_reader=SafeFileSystemReader(path, metadata))
    dcp.load(stock, checkpoint_id=path)  # DCP's own reader: fine on a checkpoint this test wrote
    assert {t.dtype for t in safe.values()} >= {torch.bfloat16, torch.float32, torch.int64}
    assert all(_same_bits(safe[k], stock[k]) for k in stock)
    assert int(safe["step"]) == 7
    # the model's tensors as they were (routed experts are stored in canonical pieces under other names)
    compared = [name for name in model.state_dict() if f"model.{name}" in safe]
    assert len(compared) > 5 and all("experts" in name for name in model.state_dict() if name not in compared)
    assert all(_same_bits(safe[f"model.{name}"], model.state_dict()[name]) for name in compared)


def test_a_dict_of_tensors_loads_bit_for_bit(checkpoint: Path) -> None:
    state = _zeros_like_stored(read_metadata(checkpoint))
    dcp.load(state, storage_reader=SafeFileSystemReader(checkpoint))
    assert state.keys() == _tensors().keys()
    assert all(_same_bits(state[k], v) for k, v in _tensors().items())


def test_loads_under_a_gloo_process_group(checkpoint: Path, tmp_path: Path) -> None:
    state = _zeros_like_stored(read_metadata(checkpoint))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(checkpoint))
    finally:
        dist.destroy_process_group()
    assert all(_same_bits(state[k], v) for k, v in _tensors().items())


WORKER = """
import sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from moe_parallel import shutdown_distributed
from moe_train.safe_dcp import SafeFileSystemReader

rank, path, marker = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{path}.store", rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))
full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)]), "step": torch.tensor(5)}, checkpoint_id=path)
# load resharded (columns, not rows): each rank reads from both ranks' files
state = {"w": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)]), "step": torch.tensor(0)}
dcp.load(state, storage_reader=SafeFileSystemReader(path))
assert torch.equal(state["w"].full_tensor(), full) and int(state["step"]) == 5
dist.barrier()
if rank == 0:
    open(path + "/.metadata", "wb").write(b"cposix\\nsystem\\n(Vtouch " + marker.encode() + b"\\ntR.")
dist.barrier()
try:
    dcp.load(state, storage_reader=SafeFileSystemReader(path))
except BaseException as err:
    assert "refused to unpickle 'posix.system'" in str(err), err
else:
    raise AssertionError("a malicious .metadata loaded")
print("rank", rank, "ok", flush=True)
shutdown_distributed()  # as moe-train leaves: a plain destroy_process_group aborted 1 exit in 6 (SIGABRT, gloo)
"""


@pytest.mark.dist
def test_two_gloo_ranks_load_a_sharded_checkpoint_and_refuse_a_malicious_one(tmp_path: Path) -> None:
    script, marker = tmp_path / "worker.py", tmp_path / "pwned"
    script.write_text(WORKER)
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(tmp_path / "ckpt"), str(marker)],
            text=True,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=120) for proc in ranks]
    finally:
        for proc in ranks:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    for rank, (proc, (stdout, stderr)) in enumerate(zip(ranks, outputs, strict=True)):
        assert proc.returncode == 0 and f"rank {rank} ok" in stdout, stderr[-3000:]
    assert not marker.exists()


# ----------------------------------------------------------------------------- tampered metadata is refused


class _Run:
    """Pickles as a call of ``func(*args)``: what a malicious pickle does."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _str(text: str) -> bytes:
    raw = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw


def _payload(kind: str, marker: Path, real: Metadata) -> tuple[bytes, str]:
    """A malicious ``.metadata`` and what the refusal names."""
    touch = f"touch {marker}"
    if kind == "os.system":
        return pickle.dumps(_Run(os.system, touch)), f"'{os.system.__module__}.system'"
    if kind == "os.system, then the real metadata":
        # unpickled, it runs os.system while building the metadata and returns the real thing (version=0)
        real.version = _Run(os.system, touch)
        return pickle.dumps(real), f"'{os.system.__module__}.system'"
    if kind == "eval":
        return pickle.dumps(_Run(eval, f"__import__('os').system({touch!r})")), "'builtins.eval'"
    if kind == "getattr":  # a route to any attribute of an allowed object
        return pickle.dumps(_Run(getattr, Metadata, "__init__")), "'builtins.getattr'"
    assert kind == "attributes of an allowed class"  # BUILD on a class object: Metadata.tampered = 1, process-wide
    build = pickle.NONE + pickle.EMPTY_DICT + _str("tampered") + pickle.BININT1 + b"\x01" + pickle.SETITEM
    head = pickle.PROTO + b"\x04" + _str(Metadata.__module__) + _str("Metadata") + pickle.STACK_GLOBAL
    return head + build + pickle.TUPLE2 + pickle.BUILD + pickle.STOP, "class Metadata"


KINDS = ["os.system", "os.system, then the real metadata", "eval", "getattr", "attributes of an allowed class"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_malicious_metadata_is_refused_and_never_runs(checkpoint: Path, tmp_path: Path, kind: str) -> None:
    payload, named = _payload(kind, tmp_path / "pwned", read_metadata(checkpoint))
    # a rank's own metadata beside it: DCP falls back to it when .metadata fails, unless the reader says otherwise
    (checkpoint / "__0.metadata").write_bytes((checkpoint / ".metadata").read_bytes())
    (checkpoint / ".metadata").write_bytes(payload)
    with pytest.raises(UnsafeCheckpointError) as err:
        read_metadata(checkpoint)
    message = str(err.value)
    assert message.startswith(f"{checkpoint / '.metadata'}: refused to ") and named in message
    assert "tampered with; do not use it" in message and "\n" not in message
    assert named in _load_error(checkpoint)
    assert not (tmp_path / "pwned").exists() and not hasattr(Metadata, "tampered")


@pytest.mark.parametrize("kind", KINDS[:3])
def test_the_malicious_payloads_do_run_under_plain_pickle(checkpoint: Path, tmp_path: Path, kind: str) -> None:
    """The payloads above are real: plain pickle (what DCP's FileSystemReader uses) runs them."""
    marker = tmp_path / "pwned"
    payload, _ = _payload(kind, marker, read_metadata(checkpoint))
    loaded = pickle.loads(payload)
    assert marker.exists()
    if kind == "os.system, then the real metadata":
        assert type(loaded) is Metadata and loaded.state_dict_metadata.keys() == _tensors().keys()


def test_metadata_holding_another_type_is_refused(checkpoint: Path) -> None:
    (checkpoint / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: holds a dict, not DCP metadata"):
        read_metadata(checkpoint)


def test_a_bytes_entry_is_refused_and_never_torch_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(3), "note": "not a tensor"}, checkpoint_id=path)
    with open(path / ".metadata", "rb") as f:  # DCP wrote it so: a real BytesStorageMetadata entry
        assert type(RestrictedUnpickler(f).load().state_dict_metadata["note"]) is BytesStorageMetadata
    loaded_bytes = []
    monkeypatch.setattr(DefaultLoadPlanner, "load_bytes", lambda self, item, value: loaded_bytes.append(item))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: entry 'note' is pickled bytes \(BytesStorage"):
        read_metadata(path)
    state = {"w": torch.zeros(3), "note": ""}
    with pytest.raises((CheckpointException, AssertionError)) as err:
        dcp.load(state, storage_reader=SafeFileSystemReader(path))
    assert "BytesStorageMetadata" in str(err.value) and not loaded_bytes and state["note"] == ""


def test_read_data_refuses_a_bytes_read_whatever_the_planner_asks(checkpoint: Path) -> None:
    reader = SafeFileSystemReader(checkpoint)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    index = MetadataIndex("w", [0, 0])
    item = ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0, 0]), index, torch.Size([0, 0]), torch.Size([4, 8]))
    with pytest.raises(UnsafeCheckpointError, match="refused to read 'w' as pickled bytes"):
        reader.read_data(LoadPlan([item]), DefaultLoadPlanner())


def test_tensor_bytes_are_read_weights_only(checkpoint: Path, tmp_path: Path) -> None:
    """A data file holding a pickle that runs code where a tensor should be: DCP's torch.load(weights_only=True)."""
    evil = io.BytesIO()
    torch.save(_Run(os.system, f"touch {tmp_path / 'pwned'}"), evil)

    def point_at_it(metadata: Metadata) -> None:
        for info in metadata.storage_data.values():
            info.offset, info.length = 0, len(evil.getvalue())

    _rewrite(checkpoint, point_at_it)
    (checkpoint / DATA_FILE).write_bytes(evil.getvalue())
    read_metadata(checkpoint)  # nothing wrong with the metadata itself
    assert "Weights only load failed" in _load_error(checkpoint)
    assert not (tmp_path / "pwned").exists()


# ----------------------------------------------------------------------------- data files: outside, missing, short


@pytest.mark.parametrize("where", ["../outside.distcp", "absolute", "symlink"])
def test_a_data_file_outside_the_checkpoint_is_refused(checkpoint: Path, tmp_path: Path, where: str) -> None:
    outside = tmp_path / "outside.distcp"
    outside.write_bytes((checkpoint / DATA_FILE).read_bytes())  # complete: only its place is wrong
    if where == "symlink":
        (checkpoint / DATA_FILE).unlink()
        (checkpoint / DATA_FILE).symlink_to(outside)
        named = f"'{DATA_FILE}' resolves outside the checkpoint directory"
    else:
        relative = str(outside) if where == "absolute" else where
        named = f"'{relative}' lies outside the checkpoint directory"

        def move(metadata: Metadata) -> None:
            for info in metadata.storage_data.values():
                info.relative_path = relative

        _rewrite(checkpoint, move)
    with pytest.raises(UnsafeCheckpointError) as err:
        read_metadata(checkpoint)
    assert str(err.value).startswith(f"{checkpoint / '.metadata'}: data file ") and named in str(err.value)
    assert named in _load_error(checkpoint)


def test_a_truncated_data_file_is_named_with_its_size(checkpoint: Path) -> None:
    data = checkpoint / DATA_FILE
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[: size // 2])
    with pytest.raises(DamagedCheckpointError) as err:
        read_metadata(checkpoint)
    assert str(err.value) == (
        f"{data}: {size // 2} bytes, its metadata reads up to byte {size} (truncated): "
        "the checkpoint is damaged: resume from an earlier one or copy it again"
    )
    assert f"{data}: {size // 2} bytes" in _load_error(checkpoint)


def test_a_missing_data_file_is_named(checkpoint: Path) -> None:
    (checkpoint / DATA_FILE).unlink()
    with pytest.raises(DamagedCheckpointError, match=rf"{DATA_FILE}: missing \(named by \.metadata\): the checkpoint"):
        read_metadata(checkpoint)


@pytest.mark.parametrize("cut", [0, 1, 100, -1])
def test_a_truncated_metadata_is_damaged(checkpoint: Path, cut: int) -> None:
    metadata = checkpoint / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:cut])
    with pytest.raises(DamagedCheckpointError, match=r"\.metadata: unreadable DCP metadata \(\w+: .*is damaged"):
        read_metadata(checkpoint)


def test_a_missing_metadata_is_named(checkpoint: Path) -> None:
    (checkpoint / ".metadata").unlink()
    with pytest.raises(DamagedCheckpointError, match=r"\.metadata: missing: not a DCP checkpoint"):
        read_metadata(checkpoint)


# ----------------------------------------------------------------------------- the allow-list


def test_the_allow_list_is_what_real_metadata_names(
    trained: tuple[Path, torch.nn.Module], checkpoint: Path, tmp_path: Path
) -> None:
    """Every global the allow-list holds appears in metadata DCP writes (dtypes: each as it pickles; PosixPath under
    the module this Python names), and real metadata names nothing else."""
    with_bytes = tmp_path / "with_bytes"
    dcp.save({"w": torch.ones(2), "note": "x"}, checkpoint_id=with_bytes)
    seen = set().union(*(_globals_named(path / ".metadata") for path in (trained[0], checkpoint, with_bytes)))
    assert seen <= ALLOWED_GLOBALS.keys()
    other_python = {("pathlib", "PosixPath"), ("pathlib._local", "PosixPath")} - {
        (pathlib.PosixPath.__module__, "PosixPath")
    }
    fixed = {key for key, value in ALLOWED_GLOBALS.items() if not isinstance(value, torch.dtype)}
    assert fixed - other_python <= seen
    dtypes = {key: value for key, value in ALLOWED_GLOBALS.items() if isinstance(value, torch.dtype)}
    assert set(dtypes.values()) == {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    for key, dtype in dtypes.items():
        (tmp_path / "dtype").write_bytes(pickle.dumps(dtype))
        assert _globals_named(tmp_path / "dtype") == {key}
