"""The estimate's inputs: plain frozen sizes of a model and of one rank's run (no torch, nothing of the other
packages), and the byte sizes the estimate counts in. :mod:`moe_memory.estimate` takes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_memory.saved_activations import SavedBytesDeclarations

FP32 = 4
INDEX = 8  # int64 indices and labels
BOOL = 1
OFFSETS = 4  # int32 group offsets of grouped_mm

DISPATCHERS = ("alltoall", "allgather", "flex")
DEFAULT_OFFLOAD_MIN_TENSOR_BYTES = 1 << 20


@dataclass(frozen=True)
class GQAShape:
    """Grouped-query attention of one layer. ``window``: this layer's sliding window (None: full causal);
    ``rotary_dim``: the dimensions of each head that rotate (None: all of ``head_dim``). ``rope`` False is a NoPE
    layer (Llama 4); ``chunk`` and ``qk_l2_norm`` apply to the layers that rotate, ``temperature_tuning`` to NoPE
    layers, as the model's attention applies the config's fields (so an MTP layer, which rotates, takes them too)."""

    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None
    sinks: bool = False  # learned attention-sink logits (GPT-OSS): the explicit softmax path
    qk_norm: bool = False
    qk_norm_across_heads: bool = False  # one norm over all heads' q (and k) per token instead of one per head
    clip_qkv: bool = False  # q, k and v clamped after the norms: the clamp saves its inputs
    rotary_dim: int | None = None
    qkv_bias: bool = False  # biases change no saved tensor; kept for completeness
    out_bias: bool = False
    rope: bool = True  # False: no rotary embeddings (NoPE)
    chunk: int | None = None  # attention within chunks of this many positions (Llama 4)
    qk_l2_norm: bool = False  # q and k scaled to unit RMS after the rotation, in fp32 (Llama 4)
    temperature_tuning: bool = False  # q times a per-position fp32 scale (Llama 4)
    output_gate: bool = False  # the output times sigmoid of a per-channel gate from the q projection (Qwen3-Next)


@dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention (DeepSeek-V3): ``q_lora_rank`` None is a full-rank q projection. ``topk``: DeepSeek
    Sparse Attention (DeepSeek-V3.2), each query attends to the ``topk`` earlier keys its lightning indexer scores
    highest (None: dense attention over every earlier key)."""

    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_dim: int
    topk: int | None = None


@dataclass(frozen=True)
class GatedDeltaNetShape:
    """A Gated DeltaNet token mixer (Qwen3-Next's linear-attention layers): ``key_heads`` query/key heads of
    ``key_dim``, ``value_heads`` value heads of ``value_dim`` (each key head serving ``value_heads / key_heads`` of
    them), a causal depthwise convolution of ``conv_kernel`` taps over q, k and v, and the chunked gated delta rule
    over chunks of ``chunk`` positions (what it saves grows with the number of chunks)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    chunk: int


@dataclass(frozen=True)
class KimiDeltaShape:
    """A Kimi Delta Attention token mixer (Kimi Linear's KDA layers): the gated delta rule with one log decay per key
    channel instead of one per head, as many value heads as query/key heads and value dims as key dims (q, k and v
    projected apart), the chunked rule computing its decayed products by sub-chunks of up to 8 positions; sizes named
    as :class:`GatedDeltaNetShape`'s. ``moe_models.recurrent_saved_bytes.record_kimi_delta`` declares its saves."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    chunk: int

    def __post_init__(self) -> None:
        if self.value_heads != self.key_heads or self.value_dim != self.key_dim:
            raise ValueError(
                f"KimiDeltaShape value_heads={self.value_heads}, value_dim={self.value_dim}: KDA has one value head "
                f"per key head and value dims equal to key dims; give {self.key_heads} and {self.key_dim}"
            )


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba-2 mixer (Nemotron-H's ``M`` layers): ``heads`` heads of ``head_dim`` channels sharing ``groups`` groups
    of B and C of ``state_dim`` (each group serving ``heads / groups`` consecutive heads), a causal depthwise
    convolution of ``conv_kernel`` taps over x, B and C, and the chunked SSD scan over chunks of ``chunk`` positions
    (what it saves grows with the number of chunks). A token mixer of :class:`LayerShape` (a hybrid pattern's ``M``
    layer); ``moe_models.recurrent_saved_bytes.mamba2_saved_bytes`` declares one alone."""

    heads: int
    head_dim: int
    groups: int
    state_dim: int
    conv_kernel: int
    chunk: int


TokenMixerShape = GQAShape | MLAShape | GatedDeltaNetShape | KimiDeltaShape | Mamba2Shape


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer: a pre-norm token-mixer block (``attention``: softmax attention, a Gated DeltaNet or a Mamba-2
    mixer) then a pre-norm channel-mixer block (``moe``: routed experts plus the shared expert, if any; False: the dense
    MLP). A hybrid pattern's layer (Nemotron-H) has one block: ``attention`` None (no token mixer), or ``channel``
    False (no channel mixer; ``moe`` is then False)."""

    attention: TokenMixerShape | None
    moe: bool = True
    channel: bool = True

    def __post_init__(self) -> None:
        if self.attention is None and not self.channel:
            raise ValueError("LayerShape: attention=None and channel=False leave the layer no block; give one of them")
        if not self.channel:  # one spelling per layer kind: the estimate counts equal layers as one kind
            object.__setattr__(self, "moe", False)


@dataclass(frozen=True)
class ExpertsShape:
    """Routed experts and their router."""

    num_experts: int
    topk: int
    ffn_hidden: int
    gated: bool = True  # swiglu / geglu / swiglu_oai: a first projection of 2 x ffn_hidden
    bias: bool = False
    score_function: str = "softmax"  # softmax | sigmoid
    pre_softmax: bool = False
    sigmoid_norm_topk: bool = True
    # balancing losses with a nonzero coefficient: aux_loss | seq_aux_loss | global_aux_loss
    aux_losses: tuple[str, ...] = ("aux_loss",)
    z_loss: bool = False
    router_bytes: int = FP32  # router dtype: 4 (fp32) or 8 (fp64)
    probs_on_input: bool = False  # the rows enter the experts times their probability (Llama 4)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    vocab: int
    layers: tuple[LayerShape, ...]
    experts: ExpertsShape | None = None
    shared_expert_ffn: int | None = None
    shared_expert_gate: bool = False  # the shared expert's output times a per-token sigmoid (Qwen2-MoE)
    dense_ffn: int = 0
    # the dense MLP's and the shared expert's activation: gated (SwiGLU, a gate and an up projection) or not
    # (squared ReLU, GELU: act(x W_up) W_down, Nemotron-H)
    mlp_gated: bool = True
    mtp_depth: int = 0
    tied_embeddings: bool = False  # changes no activation; the parameters are given
    zero_centered_norms: bool = False  # RMSNorm scales by 1 + weight, in fp32 (Qwen3-Next): its rows stay fp32
    # the attention of the MTP depths' layers (None: the last layer's, with full attention and rotary embeddings);
    # needed where the last layer has no softmax attention (a Gated DeltaNet, a Mamba-2 mixer, no token mixer)
    mtp_attention: GQAShape | MLAShape | None = None
    # what the model's modules save for backward, declared by the packages that own them (moe_memory.saved_activations;
    # moe_models.memory.model_shape sets it); not part of the shape's identity
    saved_bytes: SavedBytesDeclarations | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class PipelineShare:
    """What a pipeline-parallel rank runs of the model (its ``ModelShape`` holds its stages' layers only): whether it
    holds the embedding (first stage) and the head, loss and MTP (last stage), and how many micro-batches'
    activations of each of its stages it holds at once under the schedule."""

    first: bool
    last: bool
    inflight: int = 1
    # micro-batches in flight of the last stage itself, whose head, loss and MTP saves count that many times (None:
    # ``inflight``); the 1F1B family runs each of its backwards right after the forward: 1
    last_inflight: int | None = None


@dataclass(frozen=True)
class LocalParameters:
    """This rank's parameters as training holds them (local shards): elements, how many parameter tensors (each gets
    AdamW's 4-byte ``step``), buffer bytes, and of the elements, how many are routed experts (for reporting); of the
    elements and tensors, those no gradient reaches (DeepSeek Sparse Attention's indexers while no loss trains them):
    held, but without a gradient, optimizer states or a master copy (AdamW steps what has a gradient); of the trained
    ones, those Muon updates (``train.optimizer muon``: one momentum buffer each, no second moment, no step)."""

    numel: int
    tensors: int
    buffer_bytes: int = 0
    expert_numel: int = 0
    untrained_numel: int = 0
    untrained_tensors: int = 0
    momentum_only_numel: int = 0
    momentum_only_tensors: int = 0


@dataclass(frozen=True)
class RunShape:
    """One rank's run: batch, dtypes (bytes per element), layout and its parameter counts."""

    micro_batch: int
    seq_len: int
    params: LocalParameters
    activation_bytes: int = 2
    param_bytes: int = FP32
    grad_bytes: int = FP32
    optimizer_state_bytes: int = FP32  # exp_avg and exp_avg_sq
    master_weights_bytes: int = FP32  # a master copy of parameters that are not fp32; 0 = none
    tp: int = 1
    ep: int = 1
    etp: int = 1
    edp: int = 1
    dp: int = 1
    cp: int = 1  # context parallel: each rank holds seq_len / cp positions of every sequence, attends to all of them
    capacity_factor: float | None = None
    pad_to_capacity: bool = False
    dispatcher: str = "alltoall"  # with ep or etp > 1: alltoall | allgather | flex (estimated as alltoall)
    device: str = "cuda"  # "cpu": blockwise attention where q/k and v head dims differ (SDPA on CUDA)

    def __post_init__(self) -> None:
        for name in ("micro_batch", "seq_len", "activation_bytes", "tp", "ep", "etp", "edp", "dp", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be at least 1")
        if self.seq_len % self.tp:
            raise ValueError(f"seq_len={self.seq_len} is not divisible by tp={self.tp} (sequence parallelism)")
        if self.cp > 1 and self.seq_len % (2 * self.cp * self.tp):
            raise ValueError(
                f"seq_len={self.seq_len} is not divisible by 2 x cp x tp = {2 * self.cp * self.tp} "
                "(context parallelism)"
            )
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher={self.dispatcher!r}: choose one of {DISPATCHERS}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor!r}: must be > 0, or None for dropless")
