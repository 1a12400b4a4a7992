"""Small random-init Hugging Face causal LMs, one per architecture family, by the class of
block they have (what the planner must get right for each):

- sequential: pre-norm attention then MLP (Llama and its kin, sliding windows, GQA);
- post-norm: norms on the attention and MLP outputs before the residual add, so the
  row-parallel output is read by several ops (Gemma-2);
- qk-norm: an RMSNorm over head_dim on every query and key head after the head view
  (Qwen3): heads are independent, so it runs on this rank's heads;
- parallel: attention and MLP read the same normed input and are summed once
  (GPT-J, GPT-NeoX, Phi-2, Cohere).

Every config has hidden 64, 8 heads (4 key-value heads where the family groups them; head
dim 8), 2 layers and a vocabulary of 128, so a
4-way tensor-parallel axis splits heads, MLP and vocabulary evenly.  Dropout is 0, as the
families ship it."""
from __future__ import annotations

import torch

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS = 128, 64, 8, 4, 2


def _common(**extra) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, use_cache=False, **extra)


def _configs():
    import transformers as tf
    return {
        "llama": ("sequential", tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**_common(num_key_value_heads=KV_HEADS))),
        "qwen2": ("sequential", tf.Qwen2ForCausalLM, lambda: tf.Qwen2Config(**_common(num_key_value_heads=KV_HEADS))),
        "mistral": ("sequential", tf.MistralForCausalLM,
                    lambda: tf.MistralConfig(**_common(num_key_value_heads=KV_HEADS, sliding_window=8))),
        "gemma": ("sequential", tf.GemmaForCausalLM,
                  lambda: tf.GemmaConfig(**_common(num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS))),
        "stablelm": ("sequential", tf.StableLmForCausalLM,
                     lambda: tf.StableLmConfig(**_common(num_key_value_heads=KV_HEADS, partial_rotary_factor=0.5))),
        "starcoder2": ("sequential", tf.Starcoder2ForCausalLM,
                       lambda: tf.Starcoder2Config(**_common(num_key_value_heads=KV_HEADS))),
        "gemma2": ("post-norm", tf.Gemma2ForCausalLM,
                   lambda: tf.Gemma2Config(**_common(num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS))),
        "qwen3": ("qk-norm", tf.Qwen3ForCausalLM,
                  lambda: tf.Qwen3Config(**_common(num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS))),
        "cohere": ("parallel", tf.CohereForCausalLM,
                   lambda: tf.CohereConfig(**_common(num_key_value_heads=KV_HEADS, pad_token_id=0))),
        "mixtral": ("moe", tf.MixtralForCausalLM,
                    lambda: tf.MixtralConfig(**_common(num_key_value_heads=KV_HEADS, num_local_experts=4,
                                                       num_experts_per_tok=2))),
        "qwen2_moe": ("moe", tf.Qwen2MoeForCausalLM,
                      lambda: tf.Qwen2MoeConfig(**_common(num_key_value_heads=KV_HEADS, num_experts=4,
                                                          num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
                                                          shared_expert_intermediate_size=HIDDEN))),
        "falcon": ("fused", tf.FalconForCausalLM,
                   lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                           num_attention_heads=HEADS, use_cache=False)),
        "gptj": ("parallel", tf.GPTJForCausalLM,
                 lambda: tf.GPTJConfig(vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                       rotary_dim=8, use_cache=False)),
        "gpt_neox": ("parallel", tf.GPTNeoXForCausalLM, lambda: tf.GPTNeoXConfig(**_common())),
        "phi": ("parallel", tf.PhiForCausalLM, lambda: tf.PhiConfig(**_common())),
    }


FUSED = ["falcon"]  # fused projections split after the matmul: trained, closed form not yet met
MOE = ["mixtral", "qwen2_moe"]  # experts still replicated (no expert parallelism yet); router planned
FAMILIES = ["llama", "qwen2", "mistral", "gemma", "stablelm", "starcoder2", "gemma2", "qwen3", "gptj", "gpt_neox",
            "phi", "cohere"]


def block_class(family: str) -> str:
    return _configs()[family][0]


def build(family: str):
    """(model, kwargs) of `family`, the same on every call (seed 0): input_ids and labels of
    a batch of 4 sequences of 16 tokens."""
    _, cls, config = _configs()[family]
    torch.manual_seed(0)
    model = cls(config())
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}
