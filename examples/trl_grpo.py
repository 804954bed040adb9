"""TRL's GRPOTrainer scoring its completions with rl-fabric's ``math_answer`` (warm local pools).

Needs TRL, which the project does not depend on; in a venv of its own::

    python3 -m venv /tmp/trl-venv
    /tmp/trl-venv/bin/pip install torch==2.13.0 trl
    /tmp/trl-venv/bin/pip install -e .            # rl-fabric (math_answer needs sympy: torch brings it)
    /tmp/trl-venv/bin/python examples/trl_grpo.py

Runs offline on the CPU in about a minute: a tiny Qwen2 model with random weights and a
word-level tokenizer built here (no hub download), 2 GRPO steps of 4 prompts x 4
completions. The random policy writes numbers that are mostly wrong: the point is the
wiring (TRL calls the fabric reward with its prompts, completions and the dataset's
``ground_truth`` column; the calls run in worker processes), not learning.
``--endpoint-url http://127.0.0.1:9000`` scores through a ``fabric serve`` instead.
"""

from __future__ import annotations

import argparse
import tempfile

from fabric.integrations.trl import trl_async_reward, trl_reward

WORDS = "what is plus minus times the answer so".split() + [str(i) for i in range(20)]


def tiny_tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *WORDS, "?", "."])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def tiny_model(tokenizer):  # type: ignore[no-untyped-def]
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--endpoint-url", default=None, help="a fabric serve to score through")
    parser.add_argument("--async-reward", action="store_true", help="use the async TRL reward")
    args = parser.parse_args()

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    problems = [(a, b) for a in range(1, 5) for b in range(1, 3)]
    dataset = Dataset.from_dict(
        {
            "prompt": [f"what is {a} plus {b} ? the answer is" for a, b in problems],
            "ground_truth": [str(a + b) for a, b in problems],
        }
    )
    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    make = trl_async_reward if args.async_reward else trl_reward
    with make("math_answer", **options) as reward, tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            max_steps=args.steps,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=6,
            learning_rate=1e-3,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            bf16=False,
            save_strategy="no",
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[reward],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        trainer.train()
        for row in trainer.state.log_history:
            keys = [k for k in row if k.startswith(("reward", "math_answer"))]
            if keys:
                print({k: row[k] for k in ["step", *keys] if k in row})
        print("fabric:", reward.adapter.stats)


if __name__ == "__main__":
    main()
