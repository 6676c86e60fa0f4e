"""What every pair builder shares: the byte-level BPE tokenizer and the llama file writers.

    write_gguf(path, weights, shape, tok, f16)   # llama.cpp, q/k rows rope-permuted
    write_hf(folder, weights, shape, tok)        # transformers folder, the same F32 weights

Weights are a dict of numpy arrays under HF llama names (rotate-half rope layout), so a model
written both ways is the same model in llama.cpp and in transformers. Used by the designed tiny
pair (crossrt/builders/tinypair.py) and the trained pair (crossrt/builders/tinytrain.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<|bos|>", "<|eos|>"
BOS_ID, EOS_ID = 0, 1  # trained first, as special tokens
CONTEXT_LENGTH, RMS_EPS, ROPE_THETA = 2048, 1e-5, 10000.0


@dataclass(frozen=True)
class LlamaShape:
    name: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# ---------------------------------------------------------------- tokenizer

def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE that adds BOS, so HF and llama.cpp give the same ids for a prompt."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, BOS_ID)])
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID
    return tok


def vocab_tokens(tok: Tokenizer) -> list[str]:
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    return [by_id[i] for i in range(len(by_id))]


def merges(tok: Tokenizer) -> list[str]:
    # tokenizer.json stores merges as pairs; GGUF wants "a b" strings, in the same order.
    return [m if isinstance(m, str) else " ".join(m)
            for m in json.loads(tok.to_str())["model"]["merges"]]


# ---------------------------------------------------------------- writers

def rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF q/k rows (rope pairs i, i + hd/2) to llama.cpp's (adjacent pairs), as llama.cpp's
    convert_hf_to_gguf.py permutes them."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, w.shape[1])
            .swapaxes(1, 2).reshape(w.shape))


GGUF_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
              "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def gguf_tensors(w: dict[str, np.ndarray], spec: LlamaShape) -> dict[str, np.ndarray]:
    out = {"token_embd.weight": w["model.embed_tokens.weight"],
           "output_norm.weight": w["model.norm.weight"], "output.weight": w["lm_head.weight"]}
    for i in range(spec.n_layer):
        for name, hf_name in GGUF_NAMES.items():
            out[f"blk.{i}.{name}.weight"] = w[f"model.layers.{i}.{hf_name}.weight"]
        for name, heads in (("attn_q", spec.n_head), ("attn_k", spec.n_head_kv)):
            out[f"blk.{i}.{name}.weight"] = rope_permute(out[f"blk.{i}.{name}.weight"], heads)
    return out


def write_gguf(path: Path, w: dict[str, np.ndarray], spec: LlamaShape, tok: Tokenizer,
               f16: bool, context_length: int = CONTEXT_LENGTH) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"crossrt-{spec.name}")
    writer.add_context_length(context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_vocab_size(tok.get_vocab_size())
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    tokens = vocab_tokens(tok)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # the GPT-2 split regex, as tokenizers' ByteLevel uses
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in (BOS, EOS) else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges(merges(tok))
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    for name, arr in gguf_tensors(w, spec).items():
        # As llama.cpp's converters do: 1-D tensors (norms) stay F32 in an F16 file.
        writer.add_tensor(name, arr.astype(np.float16) if f16 and arr.ndim > 1 else arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_config(spec: LlamaShape, vocab_size: int, context_length: int = CONTEXT_LENGTH) -> dict:
    """config.json of a transformers LlamaForCausalLM matching write_gguf's metadata."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": spec.n_embd,
        "intermediate_size": spec.n_ff, "num_hidden_layers": spec.n_layer,
        "num_attention_heads": spec.n_head, "num_key_value_heads": spec.n_head_kv,
        "head_dim": spec.head_dim, "hidden_act": "silu", "max_position_embeddings": context_length,
        # LlamaConfig's defaults differ (eps 1e-6, bos 1, eos 2): say what the GGUF says.
        "rms_norm_eps": RMS_EPS, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        # rope_theta for transformers 4.x, rope_parameters for 5.x.
        "rope_theta": ROPE_THETA,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "torch_dtype": "float32", "use_cache": True,
    }


def write_hf(folder: Path, w: dict[str, np.ndarray], spec: LlamaShape, tok: Tokenizer,
             context_length: int = CONTEXT_LENGTH) -> list[Path]:
    files = {
        "config.json": hf_config(spec, tok.get_vocab_size(), context_length),
        "generation_config.json": {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
                                   "pad_token_id": EOS_ID, "do_sample": False},
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
                                  "model_max_length": context_length,
                                  "clean_up_tokenization_spaces": False},
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, obj in files.items():
        (folder / name).write_text(json.dumps(obj, indent=2) + "\n")
    (folder / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return [folder / name for name in (*files, "tokenizer.json", "model.safetensors")]
