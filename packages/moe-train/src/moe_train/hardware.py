"""Hardware profiles for ``moe-train plan --search``: one GPU's peak FLOP/s, memory and the bandwidths its
collectives run at, from a small YAML file (the built-ins are in ``moe_train/hardware_profiles/``; or a user's own)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from moe_train.config import ConfigError


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links. Bandwidths are per GPU and direction, in GB/s (1e9 bytes), as collectives achieve them."""

    name: str
    bf16_tflops: float  # dense peak
    fp8_tflops: float
    memory_gib: float  # device memory as torch reports it
    reserved_gib: float  # of it, what the CUDA context, communication buffers and fragmentation take
    hbm_gbps: float
    nvlink_domain: int  # GPUs one NVLink fabric connects (8 in an HGX node, 72 in an NVL72 rack)
    nvlink_gbps: float
    internode_gbps: float
    collective_latency_us: float  # each collective's fixed cost, added to its bytes' time
    host_gbps: float  # to and from host memory, per GPU and direction (activation offload)
    host_memory_gib: float  # host memory one GPU's offloaded activations may take

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gib - self.reserved_gib) * 2**30


def builtin_hardware() -> list[str]:
    files = resources.files("moe_train.hardware_profiles").iterdir()
    return sorted(p.name.removesuffix(".yaml") for p in files if p.name.endswith(".yaml"))


def load_hardware(name_or_path: str) -> Hardware:
    """A built-in profile by name (``h100-80gb``...) or a YAML file with :class:`Hardware`'s fields; errors are one
    line naming ``--hardware`` and what to fix."""
    if name_or_path in builtin_hardware():
        text = resources.files("moe_train.hardware_profiles").joinpath(f"{name_or_path}.yaml").read_text()
        name = name_or_path
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(
                f"--hardware {name_or_path}: neither a built-in profile ({', '.join(builtin_hardware())}) nor a "
                "YAML file"
            )
        text, name = path.read_text(), path.stem
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"--hardware {name_or_path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--hardware {name_or_path}: expected a mapping of fields, got {type(data).__name__}")
    fields = [f.name for f in dataclasses.fields(Hardware) if f.name != "name"]
    unknown = sorted(set(data) - set(fields))
    missing = [f for f in fields if f not in data]
    if unknown or missing:
        problem = f"unknown fields {', '.join(unknown)}" if unknown else f"missing fields {', '.join(missing)}"
        raise ConfigError(f"--hardware {name_or_path}: {problem}; a profile has {', '.join(fields)}")
    for key in fields:
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"--hardware {name_or_path}: {key}={value!r} must be a number >= 0")
        if key not in ("reserved_gib", "collective_latency_us") and value == 0:
            raise ConfigError(f"--hardware {name_or_path}: {key}=0 must be > 0")
    if data["reserved_gib"] >= data["memory_gib"]:
        raise ConfigError(f"--hardware {name_or_path}: reserved_gib={data['reserved_gib']} leaves no memory")
    data["nvlink_domain"] = int(data["nvlink_domain"])
    return Hardware(name=name, **data)
