"""The ``search`` tool: BM25 scores against hand-worked numbers and an independent naive
implementation, retrieval on the shipped corpus, every bad input, and calls through the
fabric (in-process and in worker processes). User corpora (directory, JSONL; through the
environment variable and the Python API) and every bad corpus: test_search_corpus.py."""

from __future__ import annotations

import math
import random
import unicodedata
import warnings
from collections import Counter

import pytest
from search_helpers import no_corpus_env, write

from fabric.backends.base import LocalConfig
from fabric.client import Client
from fabric.errors import ErrorCode
from fabric.registry import Registry
from fabric.testing import check_function
from functions.tools import search as search_mod
from functions.tools.search import (
    CORPUS_ENV,
    DEFAULT_CORPUS,
    MAX_K,
    MAX_QUERY_CHARS,
    OPENAI_SCHEMA,
    BM25Index,
    Document,
    check_arguments,
    corpus_path,
    get_index,
    load_documents,
    search,
    stem,
    tokenize,
)

# search_helpers: the shipped corpus unless a test names another
_no_corpus_env = pytest.fixture(no_corpus_env, autouse=True, name="_no_corpus_env")


def registry() -> Registry:
    reg = Registry()
    reg.discover("functions.tools.search")
    return reg


def docs(*texts: str) -> list[Document]:
    # empty titles: only the text is indexed, so the hand-worked lengths below are the texts'
    return [Document(id=f"d{i}", title="", text=t) for i, t in enumerate(texts)]


# ----------------------------------------------------------------------------- BM25 by hand

TINY = docs("apple banana apple", "banana cherry", "cherry cherry cherry date")


def test_scores_match_the_hand_worked_formula():
    # N = 3, lengths 3, 2, 4, so avgdl = 3; k1 = 1.5, b = 0.75
    # idf(t) = ln(1 + (N - n + 0.5) / (n + 0.5)); K(d) = k1 * (1 - b + b * dl / avgdl)
    # term score = idf * tf * (k1 + 1) / (tf + K)
    index = BM25Index(TINY)
    assert index.avgdl == 3
    # "apple": n = 1, idf = ln(1 + 2.5 / 1.5) = ln(8/3); d0: tf = 2, K = 1.5
    # -> ln(8/3) * 2 * 2.5 / 3.5 = ln(8/3) * 10/7
    assert index.scores("apple") == {0: pytest.approx(math.log(8 / 3) * 10 / 7)}
    # "banana", "cherry": n = 2 each, idf = ln(1 + 1.5 / 2.5) = ln(1.6)
    # d0: banana tf 1, K = 1.5 -> 2.5 / 2.5 = 1
    # d1: banana tf 1 and cherry tf 1, K = 1.5 * (0.25 + 0.75 * 2/3) = 1.125 -> 2 * 2.5 / 2.125 = 40/17
    # d2: cherry tf 3, K = 1.5 * (0.25 + 0.75 * 4/3) = 1.875 -> 3 * 2.5 / 4.875 = 20/13
    idf = math.log(1.6)
    assert index.scores("banana cherry") == {
        0: pytest.approx(idf),
        1: pytest.approx(idf * 40 / 17),
        2: pytest.approx(idf * 20 / 13),
    }
    results = index.search("banana cherry", k=3)
    assert [h.id for h in results.hits] == ["d1", "d2", "d0"]
    assert results.hits[0].score == pytest.approx(idf * 40 / 17)
    assert results.matched == 3 and results.terms == ("banana", "cherry")


def test_parameters_change_the_scores_as_the_formula_says():
    # b = 0: no length normalisation, K = k1 everywhere; k1 = 0: tf does not matter (idf only)
    flat = BM25Index(TINY, k1=1.2, b=0.0)
    assert flat.scores("cherry")[2] == pytest.approx(math.log(1.6) * 3 * 2.2 / (3 + 1.2))
    binary = BM25Index(TINY, k1=0.0, b=0.75)
    assert binary.scores("cherry") == {1: pytest.approx(math.log(1.6)), 2: pytest.approx(math.log(1.6))}
    with pytest.raises(ValueError, match="k1 >= 0"):
        BM25Index(TINY, b=1.5)


def test_each_query_term_counts_once_and_case_and_stopwords_do_not_matter():
    index = BM25Index(TINY)
    assert index.scores("apple apple APPLE") == index.scores("apple")
    assert index.scores("The apples, of course?") == index.scores("apple course")
    assert index.scores("zebra") == {} and index.search("zebra").hits == ()


def test_a_common_term_still_scores_above_zero():
    # the classic idf ln((N - n + 0.5) / (n + 0.5)) is negative for a term in most documents
    index = BM25Index(docs("common a", "common b", "common c", "rare common"))
    scores = index.scores("common")
    assert len(scores) == 4 and all(s > 0 for s in scores.values())


def naive_bm25(texts: list[list[str]], query: list[str], k1: float, b: float) -> dict[int, float]:
    """Straight from the definition, one document at a time."""
    n_docs = len(texts)
    avgdl = sum(map(len, texts)) / n_docs
    out: dict[int, float] = {}
    for i, words in enumerate(texts):
        total, matched = 0.0, False
        for term in set(query):
            tf = words.count(term)
            if not tf:
                continue
            matched = True
            n = sum(term in w for w in texts)
            idf = math.log((n_docs - n + 0.5) / (n + 0.5) + 1)
            total += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(words) / avgdl))
        if matched:
            out[i] = total
    return out


@pytest.mark.parametrize(("k1", "b"), [(1.5, 0.75), (1.2, 0.0), (2.0, 1.0), (0.5, 0.3)])
def test_index_agrees_with_a_naive_implementation(k1, b):
    rng = random.Random(f"{k1}/{b}")
    vocab = [f"w{i}" for i in range(40)]  # no stopwords, nothing to stem
    texts = [rng.choices(vocab, weights=range(40, 0, -1), k=rng.randint(1, 30)) for _ in range(150)]
    index = BM25Index(
        [Document(id=str(i), title="", text=" ".join(t)) for i, t in enumerate(texts)], k1=k1, b=b
    )
    for _ in range(30):
        query = rng.sample(vocab, rng.randint(1, 4))
        want = naive_bm25(texts, query, k1, b)
        got = index.scores(" ".join(query))
        assert got.keys() == want.keys()
        assert all(got[i] == pytest.approx(want[i]) for i in want)
        k = rng.randint(1, 12)
        ranked = sorted(want, key=lambda i: (-want[i], i))[:k]
        assert [h.id for h in index.search(" ".join(query), k).hits] == [str(i) for i in ranked]


def test_ties_keep_corpus_order():
    index = BM25Index(docs("alike words", "other", "alike words", "alike words"))
    assert [h.id for h in index.search("alike", k=2).hits] == ["d0", "d2"]


# ----------------------------------------------------------------------------- text


def test_tokenizer():
    assert tokenize("The Speed of LIGHT, in a vacuum!") == ["speed", "light", "vacuum"]
    assert tokenize("Zürich naïve 東京 x_1 2024") == ["zürich", "naïve", "東京", "x_1", "2024"]
    assert tokenize("it's what they don't do") == []  # stopwords and contraction pieces
    assert tokenize("planets countries boxes classes glass virus analysis") == [
        "planet",
        "country",
        "box",
        "class",
        "glass",
        "virus",
        "analysis",
    ]
    assert stem("gas") == "gas" and stem("bits") == "bit"


@pytest.mark.parametrize(
    "words", ["cookie cookies", "movie movies", "prize prizes", "cache caches", "axe axes", "tie ties"]
)
def test_a_singular_and_its_plural_meet(words):
    # before: cookies -> cooky but cookie -> cookie, prizes -> priz but prize -> prize
    singular, plural = tokenize(words)
    assert singular == plural
    assert stem("plane") != stem("plan")  # only plural-stripped endings lose their e


def test_words_hold_their_combining_marks_and_are_normalised():
    # before: \w split Devanagari at its vowel signs, and NFC and NFD forms never met
    assert tokenize("भाषा भारत") == ["भाषा", "भारत"]
    nfd = unicodedata.normalize("NFD", "Le café, un élève")
    assert tokenize(nfd) == tokenize("le CAFÉ, un Élève") == ["le", "café", "un", "élève"]
    full_width = "\uff21\uff22\uff23"  # ABC in full-width letters
    assert tokenize(f"Straße {full_width}") == tokenize("STRASSE abc")  # case-folded, NFKC
    index = BM25Index(docs("हिंदी एक भाषा है", "भारत भविष्य विशेष", nfd))
    assert [h.id for h in index.search("भाषा").hits] == ["d0"]
    assert [h.id for h in index.search(unicodedata.normalize("NFC", "élève")).hits] == ["d2"]


def test_cjk_is_indexed_as_character_pairs():
    # before: a whole unspaced run was one term, so no word inside it was ever found
    pairs = ["東京", "京は", "は日", "日本", "本の", "の首", "首都", "都で", "です"]
    assert tokenize("東京は日本の首都です。") == pairs
    assert tokenize("水 Python3で書く") == ["水", "python3", "で書", "書く"]
    index = BM25Index(docs("東京は日本の首都です。", "Paris est la capitale.", "서울은 한국의 수도이다"))
    assert [h.id for h in index.search("東京").hits] == ["d0"]
    assert [h.id for h in index.search("首都 東京").hits] == ["d0"]
    assert [h.id for h in index.search("한국").hits] == ["d2"]
    hit = index.search("日本", k=1).hits[0]
    assert hit.snippet == "東京は日本の首都です。"


def test_a_one_character_cjk_query_finds_the_character_inside_a_run():
    # a document's run was indexed as pairs only: 猫 matched where it stood alone, never in 小猫
    assert tokenize("小猫", document=True) == ["小猫", "小", "猫"]
    assert tokenize("小猫") == ["小猫"]  # a query's run: pairs, scored as before
    index = BM25Index(docs("我家的小猫很可爱。", "东京是日本的首都。", "猫"))
    assert {h.id for h in index.search("猫").hits} == {"d0", "d2"}
    assert [h.id for h in index.search("首都").hits] == ["d1"]
    assert index.search("猫", k=2).hits[0].id == "d2"  # the shorter document first, as BM25 ranks
    assert "小猫" in index.search("猫").hits[-1].snippet


def test_a_query_of_cjk_pairs_scores_as_before_the_characters_were_indexed():
    """The single characters a document's CJK runs now give are extra postings, not extra
    length: counted in its length (and the average), a CJK passage weighed about twice its
    pairs, so a pair query's scores moved and its ranking flipped (here: the document of 2
    CJK characters and 20 English words went above the one of 22 CJK characters), where the
    change meant pair queries to score as before."""
    english = " ".join(f"word{i}" for i in range(20))
    index = BM25Index(docs(f"猫咪 {english}", "猫咪。" + "今天天气很好我们一起去公园散步吧朋友们", "东京"))
    texts = [f"{d.title}\n{d.text}" for d in index.documents]
    lengths = [len(tokenize(t)) for t in texts]  # a query's terms: pairs and words, as before
    avgdl = sum(lengths) / len(lengths)
    idf = math.log(1 + (3 - 2 + 0.5) / (2 + 0.5))
    k1, b = index.k1, index.b
    expected = {i: idf * (k1 + 1) / (1 + k1 * (1 - b + b * lengths[i] / avgdl)) for i in (0, 1)}
    assert index.scores("猫咪") == pytest.approx(expected)
    assert [h.id for h in index.search("猫咪").hits] == ["d1", "d0"]
    assert {h.id for h in index.search("猫").hits} == {"d0", "d1"}  # and a character finds both


def test_a_singular_query_finds_the_plural_in_a_document():
    assert get_index().search("cookie").hits[0].id == "http.txt"  # it says "cookies"


# ----------------------------------------------------------------------------- shipped corpus

RANKING = {
    "how fast does light travel in a vacuum": "speed_of_light.txt",
    "who was the first person to walk on the moon": "apollo_11.txt",
    "tallest mountain above sea level": "mount_everest.txt",
    "powerhouse of the cell ATP": "mitochondria.txt",
    "longest river in Africa": "nile.txt",
    "right triangle hypotenuse": "pythagorean_theorem.txt",
    "find an item in a sorted array by halving": "binary_search.txt",
    "capital of Australia": "australia.txt",
    "who invented the printing press": "printing_press.txt",
    "distributed version control branches commits": "git.txt",
    "plants turn sunlight and carbon dioxide into sugar": "photosynthesis.txt",
    "double helix base pairs": "dna.txt",
    "deepest point of the ocean Mariana Trench": "pacific_ocean.txt",
    "entropy heat absolute zero": "thermodynamics.txt",
    "golden ratio sequence": "fibonacci.txt",
    "voltage current resistance": "ohms_law.txt",
    "404 Not Found status code": "http.txt",
    "variable-width encoding of Unicode characters": "utf8.txt",
    "coldest temperature ever recorded": "antarctica.txt",
    "Guido van Rossum": "python_language.txt",
    "pivot partition sorting algorithm": "quicksort.txt",
    "smallpox eradicated": "vaccines.txt",
    "curvature of spacetime gravitational waves": "general_relativity.txt",
}


def test_shipped_corpus_is_small_clean_and_the_default():
    files = sorted(DEFAULT_CORPUS.iterdir())
    assert 30 <= len(files) <= 60
    assert sum(f.stat().st_size for f in files) < 100_000
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped
        documents = load_documents(DEFAULT_CORPUS, strict=True)
    assert len(documents) == len(files) and len({d.id for d in documents}) == len(files)
    assert all(d.title and len(d.text.split()) >= 40 for d in documents)
    assert corpus_path() == DEFAULT_CORPUS and get_index() is get_index(DEFAULT_CORPUS)


@pytest.mark.parametrize(("query", "doc_id"), RANKING.items())
def test_shipped_corpus_ranks_the_right_document_first(query, doc_id):
    results = get_index().search(query, k=3)
    assert results.hits[0].id == doc_id, [(h.id, round(h.score, 2)) for h in results.hits]
    assert results.hits[0].score > 1.3 * results.hits[1].score if len(results.hits) > 1 else True


def test_snippet_shows_the_matching_passage():
    hit = get_index().search("Tenzing Norgay first ascent", k=1).hits[0]
    assert hit.title == "Mount Everest" and "Tenzing Norgay made the first confirmed ascent" in hit.snippet
    assert hit.snippet.startswith("…") and len(hit.snippet) <= search_mod.SNIPPET_CHARS + 2
    # a match at the start: no leading ellipsis
    hit = get_index().search("Light travels through a vacuum", k=1).hits[0]
    assert hit.snippet.startswith("Light travels through a vacuum at exactly 299,792,458")


def test_text_for_the_policy():
    text = search("speed of light", k=2)
    head, first, second = text.split("\n\n")
    assert head.startswith("Top 2 of ") and head.endswith('matching documents for "speed of light":')
    assert first.startswith("[1] Speed of light (id: speed_of_light.txt, score ")
    assert second.startswith("[2] ")
    assert search("Guido   van\nRossum", k=5).startswith('1 matching document for "Guido van Rossum":\n\n[1]')
    assert search("xylophone quasar").startswith('No documents match "xylophone quasar". Try other words')
    assert len(get_index().search("light", k=MAX_K).hits) <= MAX_K


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"query": ""}, "empty query"),
        ({"query": " \n\t "}, "empty query"),
        ({"query": "light " * 100}, f"over the {MAX_QUERY_CHARS} limit"),
        ({"query": "light", "k": 0}, "k must be an integer from 1 to 20, got 0"),
        ({"query": "light", "k": MAX_K + 1}, "got 21"),
        ({"query": "light", "k": -3}, "got -3"),
        ({"query": "light", "k": True}, "got True"),
        ({"query": "light", "k": 2.5}, "got 2.5"),
        ({"query": "the of and?!"}, "no searchable words"),
        ({"query": 42}, "query must be a string"),
    ],
)
def test_bad_arguments_say_what_to_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        search(**kwargs)


def test_longest_query_is_accepted():
    query = ("light " * MAX_QUERY_CHARS)[:MAX_QUERY_CHARS]
    assert check_arguments(query, MAX_K) == query.strip()
    assert search(query).startswith("Top 3 of ")


# ----------------------------------------------------------------------------- through the fabric


def test_conforms_and_schema_matches_signature():
    reg = registry()
    check_function("search", reg)
    spec = reg.get("search")
    assert spec.kind == "tool" and spec.setup == "functions.tools.search:default_index"
    params = OPENAI_SCHEMA["function"]["parameters"]
    assert OPENAI_SCHEMA["function"]["name"] == spec.name
    assert params["required"] == [p.name for p in spec.params if p.required]
    assert set(params["properties"]) == {p.name for p in spec.params} == {"query", "k"}
    assert params["properties"]["k"]["maximum"] == MAX_K


async def test_calls_through_an_inprocess_client():
    async with Client(backend="inproc", registry=registry()) as c:
        r = await c.call("search", {"query": "first person to walk on the moon", "k": 2})
        assert r.ok and r.value.startswith("Top 2 of ") and "[1] Apollo 11 (id: apollo_11.txt" in r.value
        r = await c.call("search", {"query": "qwertyuiop"})
        assert r.ok and r.value.startswith('No documents match "qwertyuiop"')
        for payload, message in [
            ({"query": ""}, "ValueError: empty query"),
            ({"query": "x" * (MAX_QUERY_CHARS + 1)}, "over the 500 limit"),
            ({"query": "moon", "k": 0}, "k must be an integer from 1 to 20"),
            ({"query": "moon", "k": 99}, "got 99"),
            ({"query": "the"}, "no searchable words"),
        ]:
            r = await c.call("search", payload)
            assert not r.ok and r.error.type == ErrorCode.USER_ERROR and message in r.error.message
            assert not r.error.retryable
        for payload in ({"query": "moon", "k": "three"}, {"query": 3}, {"k": 2}, {"query": "a", "path": "/"}):
            r = await c.call("search", payload)
            assert not r.ok and r.error.type == ErrorCode.INVALID_ARGUMENTS, payload


@pytest.mark.parametrize("k", [True, False, "3", 3.0])
async def test_a_k_the_tool_refuses_is_refused_through_the_fabric_too(k):
    # before: pydantic's lax mode made True 1 and "3" 3, though search(k=True) is refused
    with pytest.raises(ValueError, match="k must be an integer"):
        search("moon", k=k)
    async with Client(backend="inproc", registry=registry()) as c:
        r = await c.call("search", {"query": "moon", "k": k})
    assert not r.ok and r.error.type == ErrorCode.INVALID_ARGUMENTS and "k:" in r.error.message


async def test_setup_builds_the_index_once_per_worker(tmp_path, monkeypatch):
    write(tmp_path, "a.txt", "Tides\n\nThe Moon's gravity raises tides.")
    monkeypatch.setenv(CORPUS_ENV, str(tmp_path))
    loads = Counter[str]()
    real = search_mod.load_documents

    def counting(path, **kw):
        loads[str(path)] += 1
        return real(path, **kw)

    monkeypatch.setattr(search_mod, "load_documents", counting)
    async with Client(backend="inproc", registry=registry()) as c:
        results = await c.map("search", [{"query": "tides moon"}] * 5)
    assert all(r.ok and "[1] Tides (id: a.txt" in r.value for r in results)
    assert loads == {str(tmp_path): 1}


async def test_a_bad_corpus_fails_setup_with_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setenv(CORPUS_ENV, str(tmp_path / "nope"))
    async with Client(backend="inproc", registry=registry()) as c:
        r = await c.call("search", {"query": "moon"})
    assert not r.ok and r.error.type == ErrorCode.SETUP_FAILED
    assert f"CorpusError: search corpus {tmp_path / 'nope'} does not exist" in r.error.message
    assert CORPUS_ENV in r.error.message


async def test_worker_processes_read_the_corpus_named_by_the_environment(tmp_path, monkeypatch):
    write(tmp_path, "kelp.md", "# Kelp forests\n\nLarge brown algae that grow in cold coastal water.")
    monkeypatch.setenv(CORPUS_ENV, str(tmp_path))
    async with Client(backend=LocalConfig(max_workers=1), registry=registry()) as c:
        r = await c.call("search", {"query": "brown algae", "k": 1})
        assert r.ok and r.value.startswith('1 matching document for "brown algae":\n\n[1] Kelp forests')
        r = await c.call("search", {"query": "speed of light"})
        assert r.ok and r.value.startswith("No documents match")


def test_a_query_that_holds_the_json_arguments_says_to_pass_the_words():
    # the policy put its whole call in the string: it was searched for the words "query",
    # "speed", "light", "k" and "2", and the policy never learnt why k did not apply
    with pytest.raises(ValueError, match="pass the words themselves"):
        search('{"query": "speed of light", "k": 2}')
    assert "Speed of light" in search('{"speed of light"}')  # braces alone are punctuation
