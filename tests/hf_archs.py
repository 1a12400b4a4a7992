"""Small random-init Hugging Face causal LMs, one per architecture family, by the class of
block they have (what the planner must get right for each):

- sequential: pre-norm attention then MLP (Llama and its kin, sliding windows, GQA);
- post-norm: norms on the attention and MLP outputs before the residual add, so the
  row-parallel output is read by several ops (Gemma-2);
- qk-norm: an RMSNorm over head_dim on every query and key head after the head view
  (Qwen3): heads are independent, so it runs on this rank's heads;
- parallel: attention and MLP read the same normed input and are summed once
  (GPT-J, GPT-NeoX, Phi-2, Cohere);
- fused: one projection computes q, k and v (or gate and up) and its output is split,
  sliced, chunked or indexed by head (GPT-2, Phi-3, GPTBigCode's multi-query c_attn,
  autopar's own GPT with fused_qkv): planned as one matmul per part;
- fused-parallel: a fused multi-query projection in a parallel block (Falcon);
- moe: a top-k router and stacked experts (Mixtral, Qwen2-MoE with a shared expert, OLMoE
  with full-width QK norms, Qwen3-MoE with per-head QK norms, GraniteMoE); MOE_MORE: eight
  further families (DeepSeek-V2 and -V3 with latent attention, shared experts and
  group-limited routers, GLM-4-MoE, ERNIE-4.5-MoE, Hunyuan-MoE, dots.llm1, MiniMax, FlexOlmo).

Every config has hidden 64, 8 heads (4 key-value heads where the family groups them; head
dim 8), 2 layers and a vocabulary of 128, so a
4-way tensor-parallel axis splits heads, MLP and vocabulary evenly.  Dropout is 0, as the
families ship it."""
from __future__ import annotations

import torch

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS = 128, 64, 8, 4, 2


def _common(layers: int, **extra) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
                num_attention_heads=HEADS, use_cache=False, **extra)


def _configs(layers: int = LAYERS):
    import transformers as tf
    return {
        "llama": ("sequential", tf.LlamaForCausalLM,
                  lambda: tf.LlamaConfig(**_common(layers, num_key_value_heads=KV_HEADS))),
        "qwen2": ("sequential", tf.Qwen2ForCausalLM,
                  lambda: tf.Qwen2Config(**_common(layers, num_key_value_heads=KV_HEADS))),
        "mistral": ("sequential", tf.MistralForCausalLM,
                    lambda: tf.MistralConfig(**_common(layers, num_key_value_heads=KV_HEADS, sliding_window=8))),
        "gemma": ("sequential", tf.GemmaForCausalLM,
                  lambda: tf.GemmaConfig(**_common(layers, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS))),
        "stablelm": ("sequential", tf.StableLmForCausalLM,
                     lambda: tf.StableLmConfig(**_common(layers, num_key_value_heads=KV_HEADS,
                                                         partial_rotary_factor=0.5))),
        "starcoder2": ("sequential", tf.Starcoder2ForCausalLM,
                       lambda: tf.Starcoder2Config(**_common(layers, num_key_value_heads=KV_HEADS))),
        "gemma2": ("post-norm", tf.Gemma2ForCausalLM,
                   lambda: tf.Gemma2Config(**_common(layers, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS))),
        "qwen3": ("qk-norm", tf.Qwen3ForCausalLM,
                  lambda: tf.Qwen3Config(**_common(layers, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS))),
        "cohere": ("parallel", tf.CohereForCausalLM,
                   lambda: tf.CohereConfig(**_common(layers, num_key_value_heads=KV_HEADS, pad_token_id=0))),
        "mixtral": ("moe", tf.MixtralForCausalLM,
                    lambda: tf.MixtralConfig(**_common(layers, num_key_value_heads=KV_HEADS, num_local_experts=4,
                                                       num_experts_per_tok=2))),
        "qwen2_moe": ("moe", tf.Qwen2MoeForCausalLM,
                      lambda: tf.Qwen2MoeConfig(**_common(layers, num_key_value_heads=KV_HEADS, num_experts=4,
                                                          num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
                                                          shared_expert_intermediate_size=HIDDEN))),
        "gpt2": ("fused", tf.GPT2LMHeadModel,
                 lambda: tf.GPT2Config(vocab_size=VOCAB, n_positions=512, n_embd=HIDDEN, n_layer=layers, n_head=HEADS,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)),
        "phi3": ("fused", tf.Phi3ForCausalLM,
                 lambda: tf.Phi3Config(**_common(layers, num_key_value_heads=KV_HEADS, pad_token_id=0))),
        "gpt_bigcode": ("fused", tf.GPTBigCodeForCausalLM,
                        lambda: tf.GPTBigCodeConfig(vocab_size=VOCAB, n_positions=512, n_embd=HIDDEN, n_layer=layers,
                                                    n_head=HEADS, multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0,
                                                    attn_pdrop=0.0, use_cache=False)),
        "olmoe": ("moe", tf.OlmoeForCausalLM,  # full-width QK norms too
                  lambda: tf.OlmoeConfig(**_common(layers, num_key_value_heads=KV_HEADS, num_experts=4,
                                                   num_experts_per_tok=2))),
        "qwen3_moe": ("moe", tf.Qwen3MoeForCausalLM,
                      lambda: tf.Qwen3MoeConfig(**_common(layers, num_key_value_heads=KV_HEADS, num_experts=4,
                                                          num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
                                                          head_dim=HIDDEN // HEADS))),
        "granitemoe": ("moe", tf.GraniteMoeForCausalLM,
                       lambda: tf.GraniteMoeConfig(**_common(layers, num_key_value_heads=KV_HEADS, num_local_experts=4,
                                                             num_experts_per_tok=2))),
        "falcon": ("fused-parallel", tf.FalconForCausalLM,
                   lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers,
                                           num_attention_heads=HEADS, use_cache=False)),
        "gptj": ("parallel", tf.GPTJForCausalLM,
                 lambda: tf.GPTJConfig(vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=layers, n_head=HEADS,
                                       rotary_dim=8, use_cache=False)),
        "gpt_neox": ("parallel", tf.GPTNeoXForCausalLM, lambda: tf.GPTNeoXConfig(**_common(layers, ))),
        # eight further MoE families (shared experts, group-limited routers, latent attention)
        "deepseek_v2": ("moe", tf.DeepseekV2ForCausalLM, lambda: tf.DeepseekV2Config(**_common(
            layers, num_key_value_heads=HEADS, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
            n_shared_experts=1, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1))),
        "deepseek_v3": ("moe", tf.DeepseekV3ForCausalLM, lambda: tf.DeepseekV3Config(**_common(
            layers, num_key_value_heads=HEADS, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
            n_shared_experts=1, first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1))),
        "glm4_moe": ("moe", tf.Glm4MoeForCausalLM, lambda: tf.Glm4MoeConfig(**_common(
            layers, num_key_value_heads=KV_HEADS, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
            n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1, head_dim=HIDDEN // HEADS))),
        "ernie4_5_moe": ("moe", tf.Ernie4_5_MoeForCausalLM, lambda: tf.Ernie4_5_MoeConfig(**_common(
            layers, num_key_value_heads=KV_HEADS, moe_num_experts=4, moe_k=2, moe_intermediate_size=HIDDEN,
            moe_layer_start_index=0))),
        "hunyuan_v1_moe": ("moe", tf.HunYuanMoEV1ForCausalLM, lambda: tf.HunYuanMoEV1Config(**_common(
            layers, num_key_value_heads=KV_HEADS, num_experts=4, moe_topk=2, head_dim=HIDDEN // HEADS))),
        "dots1": ("moe", tf.Dots1ForCausalLM, lambda: tf.Dots1Config(**_common(
            layers, num_key_value_heads=KV_HEADS, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
            n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1, head_dim=HIDDEN // HEADS))),
        "minimax": ("moe", tf.MiniMaxForCausalLM, lambda: tf.MiniMaxConfig(**_common(
            layers, num_key_value_heads=KV_HEADS, num_local_experts=4, num_experts_per_tok=2, head_dim=HIDDEN // HEADS))),
        # Llama-4: a sigmoid router whose scores scale the tokens, repeated once per expert, and
        # the experts as batched matmuls over every token (no dispatch), beside a shared expert
        "llama4": ("moe-dense", tf.Llama4ForCausalLM, lambda: tf.Llama4TextConfig(**{**_common(
            layers, num_key_value_heads=KV_HEADS, num_local_experts=4, num_experts_per_tok=1,
            intermediate_size_mlp=2 * HIDDEN, head_dim=HIDDEN // HEADS), "intermediate_size": HIDDEN})),
        # GPT-OSS: biased experts with interleaved gate and up columns and a clamped gate,
        # attention sinks, sliding-window layers among full ones
        "gpt_oss": ("moe", tf.GptOssForCausalLM, lambda: tf.GptOssConfig(**_common(
            layers, num_key_value_heads=KV_HEADS, num_local_experts=4, num_experts_per_tok=2, head_dim=HIDDEN // HEADS,
            layer_types=["sliding_attention", "full_attention"][:layers] * (layers // 2 or 1), sliding_window=8))),
        # Mamba: a selective state-space scan with a depthwise causal conv1d, no attention
        "mamba": ("ssm", tf.MambaForCausalLM, lambda: tf.MambaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, state_size=8, num_hidden_layers=layers, expand=2, conv_kernel=4,
            use_cache=False)),
        "flex_olmo": ("moe", tf.FlexOlmoForCausalLM, lambda: tf.FlexOlmoConfig(**_common(
            layers, num_key_value_heads=KV_HEADS, num_experts=4, num_experts_per_tok=2, pad_token_id=0))),
        "phi": ("parallel", tf.PhiForCausalLM, lambda: tf.PhiConfig(**_common(layers, ))),
        # PhiMoE: a sparse mixer router that draws noise in training (exponential_, rand_like, uniform_)
        "phimoe": ("moe", tf.PhimoeForCausalLM, lambda: tf.PhimoeConfig(**_common(
            layers, num_key_value_heads=KV_HEADS, num_local_experts=4, num_experts_per_tok=2))),
        # DBRX: experts with flat stacked weights (w1, v1, w2 [experts * inner, hidden]) and a
        # fused qkv clipped to clip_qkv (transformers needs rope_theta in attn_config and a clip)
        "dbrx": ("moe", tf.DbrxForCausalLM, lambda: tf.DbrxConfig(
            vocab_size=VOCAB, d_model=HIDDEN, n_heads=HEADS, n_layers=layers, max_seq_len=64, use_cache=False,
            attn_config={"kv_n_heads": KV_HEADS, "rope_theta": 10000.0, "clip_qkv": 8.0},
            ffn_config={"ffn_hidden_size": HIDDEN, "moe_num_experts": 4, "moe_top_k": 2})),
        # JetMoE: experts and attention experts as grouped linear layers called with the rows
        # sorted by expert and split sizes read with .tolist() (known only when the step runs)
        "jetmoe": ("moe-grouped", tf.JetMoeForCausalLM, lambda: tf.JetMoeConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_key_value_heads=KV_HEADS // 2,
            kv_channels=HIDDEN // HEADS, intermediate_size=HIDDEN, num_local_experts=4, num_experts_per_tok=2,
            use_cache=False)),
    }


FUSED = ["gpt2", "phi3", "gpt_bigcode", "gpt_fused", "falcon"]
MOE = ["mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "granitemoe"]  # experts as one op (autopar/trace/experts.py)
MOE_MORE = ["deepseek_v2", "deepseek_v3", "glm4_moe", "ernie4_5_moe", "hunyuan_v1_moe", "dots1", "minimax",
            "flex_olmo", "gpt_oss", "dbrx"]
FAMILIES = ["llama", "qwen2", "mistral", "gemma", "stablelm", "starcoder2", "gemma2", "qwen3", "gptj", "gpt_neox",
            "phi", "cohere"]


def block_class(family: str) -> str:
    return "fused" if family == "gpt_fused" else _configs()[family][0]


def build(family: str, seq: int = 16, layers: int = LAYERS):
    """(model, kwargs) of `family` with `layers` layers, the same on every call (seed 0):
    input_ids and labels of a batch of 4 sequences of `seq` tokens (`idx` and `targets` for
    autopar's own GPT)."""
    ids = torch.randint(0, VOCAB, (4, seq), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    if family == "gpt_fused":
        from autopar.models import GPT, GPTConfig
        model = GPT(GPTConfig(vocab=VOCAB, max_seq=512, hidden=HIDDEN, n_layers=layers, n_heads=HEADS, fused_qkv=True))
        return model, {"idx": ids, "targets": ids}
    _, cls, config = _configs(layers)[family]
    model = cls(config())
    return model, {"input_ids": ids, "labels": ids}
