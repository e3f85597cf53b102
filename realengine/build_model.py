"""Build the tiny model the real-engine tests serve with vLLM's CPU build: no hub, no download.

Run with the vLLM environment's interpreter (it has torch, transformers and tokenizers):

    .venv-vllm/bin/python realengine/build_model.py DIR

It writes a Hugging Face model directory that `vllm serve DIR` loads: a random-init Llama
(2 layers, hidden 128, 4 heads, 2 KV heads of head_dim 32, vocab 4096, 131072 positions, bf16,
0.8 M parameters; its outputs are noise, its costs and KV geometry are a Llama's) and a byte-level
BPE tokenizer trained here on text already on the machine (the Python standard library's
sources, a fixed sorted selection, so every machine of this kind builds the same vocabulary), with
an end token the engine stops on and a chat template. About 25 s on 2 cores. `DIR/.built` holds
BUILD_VERSION: a directory with the same version is reused as it is.

This script runs in the engine's environment, not the service's: it imports nothing of ours.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

#: Bump when anything below changes what is built: the cached model is rebuilt.
BUILD_VERSION = "1"
VOCAB = 4096
END = "<|end|>"
SPECIAL = ("<|begin|>", END, "<|user|>", "<|assistant|>", "<|system|>")
#: Roles on lines of their own, an end token after each message; the generation prompt opens the
#: assistant's turn. Every message costs its text plus a few tokens, as real templates do.
CHAT_TEMPLATE = (
    "{{ '<|begin|>' }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
#: About 4 MB of the standard library's sources: enough text for a 4,096-token vocabulary.
CORPUS_BYTES = 4_000_000


def corpus() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
        if size >= CORPUS_BYTES:
            break
    return texts


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin|>", eos_token=END, pad_token=END)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 131072
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=131072, rope_theta=500000.0,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    (out / ".built").write_text(json.dumps({"version": BUILD_VERSION}))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: build_model.py DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    marker = out / ".built"
    if marker.exists() and json.loads(marker.read_text()).get("version") == BUILD_VERSION:
        print(f"{out}: built already (version {BUILD_VERSION})")
        return 0
    build(out)
    print(f"{out}: built (version {BUILD_VERSION})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
