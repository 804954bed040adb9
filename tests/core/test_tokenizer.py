import json

import pytest

import envpool
import envpool.envs
from core.policy.tokenizer import END, SPECIALS, WordTokenizer, detokenize, tokenize


@pytest.fixture
def lake_text() -> str:
    env = envpool.make("frozenlake-v1")
    obs, _ = env.reset(seed=7)
    return obs.text + "\n" + env.step("right").obs.text + "\n" + env.step("jump").obs.text


def test_pieces_are_words_digits_marks_and_newlines():
    assert tokenize("FrozenLake 4x4: row 12,\n@ F") == [
        "FrozenLake",
        "4",
        "x",
        "4",
        ":",
        "row",
        "1",
        "2",
        ",",
        "\n",
        "@",
        "F",
    ]


def test_specials_come_first_with_fixed_ids():
    tok = WordTokenizer(["right"])
    assert tok.vocab[: len(SPECIALS)] == list(SPECIALS)
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert tok.vocab[tok.end_id] == END
    assert tok.stop_ids == {tok.end_id, tok.eos_id}


def test_training_is_deterministic_whatever_the_corpus_order(lake_text):
    lines = lake_text.split("\n")
    a = WordTokenizer.train(lines)
    b = WordTokenizer.train(list(reversed(lines)))
    assert a.vocab == b.vocab
    # most frequent first, ties alphabetical
    counts = {w: tokenize(lake_text).count(w) for w in a.vocab[len(SPECIALS) :]}
    words = a.vocab[len(SPECIALS) :]
    assert words == sorted(words, key=lambda w: (-counts[w], w))


def test_round_trip_up_to_whitespace(lake_text):
    tok = WordTokenizer.train([lake_text])
    ids = tok.encode(lake_text)
    assert tok.unk_id not in ids
    assert tokenize(tok.decode(ids)) == tokenize(lake_text)
    assert tok.decode(tok.encode("You moved right.")) == "You moved right."
    assert tok.decode(tok.encode("Legend: @ you, S start (safe).")) == "Legend: @ you, S start (safe)."


def test_unknown_words_map_to_unk_and_decode_visibly():
    tok = WordTokenizer.train(["left right"])
    ids = tok.encode("left banana right")
    assert ids == [tok.token_to_id("left"), tok.unk_id, tok.token_to_id("right")]
    assert tok.decode(ids) == "left <unk> right"


def test_chat_template():
    tok = WordTokenizer.train(["walk left right"])
    msgs = [
        {"role": "system", "content": "walk"},
        {"role": "user", "content": "left"},
        {"role": "assistant", "content": "right"},
        {"role": "user", "content": "left"},
    ]
    ids = tok.encode_chat(msgs)
    assert [tok.vocab[i] for i in ids] == [
        "<bos>",
        "<|system|>",
        "walk",
        "<|end|>",
        "<|user|>",
        "left",
        "<|end|>",
        "<|assistant|>",
        "right",
        "<|end|>",
        "<|user|>",
        "left",
        "<|end|>",
        "<|assistant|>",
    ]
    assert tok.encode_chat(msgs, add_generation_prompt=False) == ids[:-1]


def test_chat_accepts_message_objects_and_empty_content():
    from fabric.protocol import Message

    tok = WordTokenizer.train(["hi"])
    ids = tok.encode_chat([Message(role="user", content="hi"), Message(role="assistant", content=None)])
    assert [tok.vocab[i] for i in ids] == [
        "<bos>",
        "<|user|>",
        "hi",
        "<|end|>",
        "<|assistant|>",
        "<|end|>",
        "<|assistant|>",
    ]


def test_text_cannot_forge_special_tokens():
    tok = WordTokenizer.train(["<|end|><|user|>"])
    ids = tok.encode("<|end|><|user|>")
    assert not set(ids) & tok.special_ids
    assert [tok.vocab[i] for i in ids] == ["<", "|", "end", "|", ">", "<", "|", "user", "|", ">"]


def test_bad_roles_and_ids_are_clear_errors():
    tok = WordTokenizer.train(["hi"])
    with pytest.raises(ValueError, match="message 0: unknown role 'robot'"):
        tok.encode_chat([{"role": "robot", "content": "hi"}])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="not a single piece"):
        WordTokenizer(["two words"])


def test_decode_skips_specials_unless_asked():
    tok = WordTokenizer.train(["right"])
    ids = [tok.token_to_id("right"), tok.end_id]
    assert tok.decode(ids) == "right"
    assert tok.decode(ids, skip_special=False) == "right <|end|>"


def test_save_load(tmp_path, lake_text):
    tok = WordTokenizer.train([lake_text])
    path = tmp_path / "tok.json"
    tok.save(path)
    again = WordTokenizer.load(path)
    assert again == tok and again.encode(lake_text) == tok.encode(lake_text)
    data = json.loads(path.read_text())
    data["specials"] = data["specials"][::-1]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="specials"):
        WordTokenizer.load(path)
    with pytest.raises(ValueError, match="not a word-tokenizer/v1"):
        WordTokenizer.from_dict({"format": "bpe"})


def test_detokenize_glues_punctuation():
    assert detokenize(["row", "0", ",", "column", "1", "."]) == "row 0, column 1."
    assert detokenize(["(", "safe", ")", "\n", "S", "F"]) == "(safe)\nS F"


@pytest.mark.parametrize(
    "text",
    [
        "Answer: 37",
        "x is 3.5 now",
        "run_tests",
        '{"tool": "calculator", "arguments": {"expression": "12"}}',
        'He said "hi there" ok.',
        "row 0, column 1.",
        "1, 2, 3",
    ],
)
def test_what_the_policy_writes_decodes_exactly(text):
    # digits decoded apart ("Answer: 3 7"): the tiny policy could not state any number above
    # 9, nor a JSON tool call or run_tests (found by review)
    assert detokenize(tokenize(text)) == text


def test_a_tool_call_decodes_to_json_and_a_tensor_decodes_without_specials():
    import torch

    call = detokenize(tokenize('{"tool": "calculator", "arguments": {"expression": "12*7"}}'))
    assert json.loads(call) == {"tool": "calculator", "arguments": {"expression": "12 * 7"}}
    tok = WordTokenizer(["right"])
    ids = torch.tensor([tok.bos_id, tok.token_to_id("right"), tok.end_id])
    assert tok.decode(ids) == "right"
