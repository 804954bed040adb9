"""The ``search`` tool's user corpora: a directory of files and a JSONL file, read through
the Python API, the environment variable (and the per-process cache) and an explicit index;
every bad document (skipped with one warning, or refused when strict) and every unusable
corpus path. The scores, the shipped corpus and calls through the fabric: test_search.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from search_helpers import no_corpus_env, write

from functions.tools import search as search_mod
from functions.tools.search import (
    CORPUS_ENV,
    DEFAULT_CORPUS,
    CorpusError,
    CorpusWarning,
    clear_cache,
    corpus_path,
    get_index,
    load_documents,
    load_index,
    search,
)

# search_helpers: the shipped corpus unless a test names another
_no_corpus_env = pytest.fixture(no_corpus_env, autouse=True, name="_no_corpus_env")


# ----------------------------------------------------------------------------- user corpora


def test_directory_corpus(tmp_path):
    write(tmp_path, "alpha.txt", "Alpha particles\n\nHelium nuclei emitted in radioactive decay.")
    write(
        tmp_path,
        "notes/beta.md",
        "# Beta decay\n\nA neutron turns into a proton, an electron and a neutrino.",
    )
    long_first = "gamma rays are " + "very " * 40 + "energetic photons"
    write(tmp_path, "notes/gamma-rays.txt", long_first + "\nsecond line")
    write(tmp_path, ".hidden.txt", "hidden helium")
    write(tmp_path, ".git/config.txt", "hidden helium")
    write(tmp_path, "skip.rst", "helium in another format")
    documents = load_documents(tmp_path)
    assert [(d.id, d.title) for d in documents] == [
        ("alpha.txt", "Alpha particles"),
        ("notes/beta.md", "Beta decay"),
        ("notes/gamma-rays.txt", "gamma rays"),  # a first line over 120 characters is text
    ]
    assert documents[0].text == "Helium nuclei emitted in radioactive decay."
    assert documents[2].text.startswith("gamma rays are very")
    index = load_index(tmp_path)
    assert [h.id for h in index.search("helium").hits] == ["alpha.txt"]
    assert index.search("neutrino proton").hits[0].title == "Beta decay"
    assert index.search("energetic photons").hits[0].id == "notes/gamma-rays.txt"


def test_utf8_bom_and_single_line_documents(tmp_path):
    write(tmp_path, "a.txt", "\ufeffQuarks\n\nUp, down, strange, charm, bottom, top.")
    write(tmp_path, "b.txt", "Just a title about gluons")
    documents = load_documents(tmp_path)
    assert documents[0].title == "Quarks" and documents[1].text == ""
    assert load_index(tmp_path).search("gluons").hits[0].snippet == "Just a title about gluons"


def test_bad_files_are_skipped_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(search_mod, "MAX_DOC_BYTES", 200)
    write(tmp_path, "good.txt", "Good\n\nA readable document about comets.")
    write(tmp_path, "latin1.txt", "Caf\xe9 cr\xe8me".encode("latin-1"))
    write(tmp_path, "empty.md", "  \n\n ")
    write(tmp_path, "huge.txt", "comets " * 100)
    (tmp_path / "dangling.txt").symlink_to(tmp_path / "nowhere.txt")
    with pytest.warns(CorpusWarning) as caught:
        documents = load_documents(tmp_path)
    assert [d.id for d in documents] == ["good.txt"]
    message = str(caught[0].message)
    assert "4 document(s) skipped" in message
    assert "latin1.txt: not UTF-8 (byte 0xe9 at offset 3)" in message
    assert "empty.md: empty" in message
    assert "huge.txt: 700 bytes, over the 200-byte limit; split it" in message
    assert "dangling.txt: cannot be read" in message
    with pytest.raises(CorpusError, match="4 document"):
        load_documents(tmp_path, strict=True)


def test_a_corpus_with_no_usable_document_is_an_error(tmp_path):
    write(tmp_path, "latin1.txt", b"\xff\xfe bad")
    write(tmp_path, "empty.txt", "")
    with pytest.raises(CorpusError, match=r"no \.txt or \.md documents \(2 skipped: .*not UTF-8"):
        load_documents(tmp_path)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "does not exist"),
        (lambda p: p, r"has no \.txt or \.md documents; point RL_FABRIC_SEARCH_CORPUS at"),
        (lambda p: write(p, "corpus.csv", "id,text\n1,hello"), "neither a directory nor a .jsonl file"),
        (lambda p: p / "missing.jsonl", "does not exist"),
        (lambda p: write(p, "empty.jsonl", "\n\n"), "has no documents"),
    ],
)
def test_unusable_corpus_paths(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(CorpusError, match=message) as e:
        load_index(path)
    assert "unset it to use the shipped corpus" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_unreadable_directory_simulated(tmp_path, monkeypatch):
    # what the permission test below checks, also where the tests run as root
    write(tmp_path, "a.txt", "a document")
    write(tmp_path, "locked/b.txt", "another")
    real_scandir, real_listdir = os.scandir, os.listdir

    def scandir(path):
        if str(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    def listdir(path):
        if Path(path) == tmp_path:
            raise PermissionError(13, "Permission denied", str(path))
        return real_listdir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.warns(CorpusWarning, match="locked: directory cannot be read"):
        assert [d.id for d in load_documents(tmp_path)] == ["a.txt"]
    monkeypatch.setattr(os, "listdir", listdir)
    with pytest.raises(CorpusError, match=r"directory .* cannot be read \(Permission denied\)"):
        load_documents(tmp_path)


# the same with a real chmod, for a non-root run; the test above plays the OS's refusal and
# runs as root too (CI), so this one's skip leaves nothing unchecked there
@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory (the test above covers it)")
def test_unreadable_directory(tmp_path):
    corpus = tmp_path / "corpus"
    write(corpus, "a.txt", "a document")
    write(corpus, "locked/b.txt", "another")
    (corpus / "locked").chmod(0)
    try:
        with pytest.warns(CorpusWarning, match="locked: directory cannot be read"):
            assert [d.id for d in load_documents(corpus)] == ["a.txt"]
        corpus.chmod(0)
        with pytest.raises(CorpusError, match="cannot be read"):
            load_documents(corpus)
    finally:
        corpus.chmod(0o755)
        (corpus / "locked").chmod(0o755)


def test_jsonl_corpus(tmp_path):
    lines = [
        json.dumps({"id": "e1", "title": "Electrons", "text": "Electrons carry negative charge."}),
        "",
        json.dumps({"text": "Protons carry positive charge."}),  # id: the line number; title: the id
        json.dumps({"id": 7, "text": "Neutrons have no charge.", "title": "Neutrons"}),
    ]
    path = write(tmp_path, "physics.jsonl", "\n".join(lines) + "\n")
    documents = load_documents(path)
    assert [(d.id, d.title) for d in documents] == [("e1", "Electrons"), ("3", "3"), ("7", "Neutrons")]
    assert load_index(path).search("positive charge").hits[0].id == "3"


def test_bad_jsonl_lines_are_skipped(tmp_path):
    lines = [
        json.dumps({"id": "ok", "text": "fine text"}).encode(),
        b"{not json",
        b"[1, 2]",
        json.dumps({"id": "no-text"}).encode(),
        json.dumps({"id": "blank", "text": "   "}).encode(),
        json.dumps({"id": [1], "text": "x"}).encode(),
        json.dumps({"id": "t", "title": 3, "text": "x"}).encode(),
        json.dumps({"id": "ok", "text": "again"}).encode(),
        '{"id": "latin", "text": "caf\xe9"}'.encode("latin-1"),
    ]
    path = write(tmp_path, "c.jsonl", b"\n".join(lines))
    with pytest.warns(CorpusWarning) as caught:
        assert [d.id for d in load_documents(path)] == ["ok"]
    message = str(caught[0].message)
    for expected in (
        "8 document(s) skipped",
        "line 2: not JSON",
        "line 3: not a JSON object but list",
        'line 4: needs a non-empty string "text"',
        "line 5: needs a non-empty",
        'line 6: "id" must be a string or an integer',
        'line 7: "title" must be a string',
        "line 8: repeats id 'ok'",
        "line 9: not UTF-8",
    ):
        assert expected in message
    with pytest.raises(CorpusError, match="line 2: not JSON"):
        load_documents(path, strict=True)


def test_environment_variable_and_cache(tmp_path, monkeypatch):
    write(tmp_path, "a.txt", "Comets\n\nIcy bodies that grow tails near the Sun.")
    monkeypatch.setenv(CORPUS_ENV, str(tmp_path))
    assert corpus_path() == tmp_path
    index = get_index()
    assert index is get_index(tmp_path) and index.source == str(tmp_path)
    assert "[1] Comets (id: a.txt" in search("comet tails")
    write(tmp_path, "b.txt", "Asteroids\n\nRocky bodies.")
    assert "No documents match" in search("asteroids")  # built once, kept
    clear_cache()
    assert "[1] Asteroids" in search("asteroids")
    monkeypatch.setenv(CORPUS_ENV, "  ")
    assert corpus_path() == DEFAULT_CORPUS


def test_explicit_index_through_ctx(tmp_path):
    write(tmp_path, "a.txt", "Lichens\n\nA partnership of a fungus and an alga.")
    assert "[1] Lichens" in search("fungus", ctx=load_index(tmp_path))
