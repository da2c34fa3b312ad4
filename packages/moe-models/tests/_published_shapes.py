"""Published model shapes the moe-models tests build (Qwen3 model cards, Megatron field names)."""

QWEN3_30B_A3B = {
    "vocab_size": 151_936,
    "hidden_size": 2048,
    "num_layers": 48,
    "num_attention_heads": 32,
    "num_query_groups": 4,
    "kv_channels": 128,
    "num_moe_experts": 128,
    "moe_router_topk": 8,
    "moe_ffn_hidden_size": 768,
}
