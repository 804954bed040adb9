"""A tiny, randomly initialised Qwen2 chat model with its own tokenizer, built offline.

    python benchmarks/gpu/make_tiny_hf_model.py /tmp/tiny-qwen2
    RL_FABRIC_VLLM_TEST_MODEL=/tmp/tiny-qwen2 pytest -m gpu tests/core/test_vllm_engine.py

For the GPU tests of the vllm engine on a machine with no internet and no Hugging Face cache:
a byte-level BPE tokenizer trained on a few KB of generated English (ASCII bytes only, ChatML
special tokens, a ChatML ``chat_template``) and a 2-layer ``Qwen2ForCausalLM`` (hidden 256,
head_dim 64 as Qwen2.5-0.5B, tied embeddings, bfloat16, weights from a fixed seed) saved
together with ``save_pretrained``. Its output is gibberish; the tests only compare vLLM with
a transformers reference of the same weights.

``--init-std`` is the weights' standard deviation: 0.05, larger than Hugging Face's 0.02 so
the MLP matters to the next token (the weight-loading test zeroes ``mlp.down_proj`` and
expects greedy decoding to change), small enough that vLLM's bfloat16 logprobs stay within
the test's 0.05 of the float32 reference (with 0.1 and hidden 128 one of 24 was 0.062 off)."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = (
    "the a an of to and in is was it for on with as at by from this that be are were you i we "
    "they he she one two three four five six seven eight nine ten eleven twelve twenty count "
    "number move left right up down go stop lake frozen ice hole goal start step path agent "
    "write long story about tell me paris france capital city river bridge museum tower "
    "system user assistant answer question yes no maybe because so then next after before "
    "cold warm snow winter day night light dark walk run jump slip fall safe reach"
).split()


def corpus(seed: int, sentences: int = 1500) -> list[str]:
    rng = random.Random(seed)
    lines = [
        "Count from 1 to 20. " + " ".join(str(i) for i in range(1, 21)),
        "Move: left right up down. Move left. Move right. Move up. Move down.",
        "The capital of France is Paris. Tell me about Paris.",
        "Write a long story about a frozen lake.",
    ]
    for _ in range(sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 100)))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return lines


def make_tokenizer(out: Path, vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        # no initial_alphabet: only the corpus's (ASCII) bytes, so every token decodes to
        # text; a lone non-ASCII byte decodes to nothing in vLLM's incremental detokenizer,
        # and a random model's greedy output can be made of them
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def make_model(out: Path, tokenizer, *, hidden: int, layers: int, init_std: float, seed: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = len(tokenizer)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,  # head_dim 64, as Qwen2.5-0.5B (flash attention's sizes)
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=init_std,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # _init_weights may differ across versions: set them here
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:  # weights and the q/k/v biases
                p.normal_(0.0, init_std)
    model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256, help="a multiple of 128")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--init-std", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(a.out, a.vocab_size, a.seed)
    make_model(a.out, tokenizer, hidden=a.hidden, layers=a.layers, init_std=a.init_std, seed=a.seed)
    print(f"wrote {a.out}: vocab {len(tokenizer)}, hidden {a.hidden}, layers {a.layers}")


if __name__ == "__main__":
    main()
