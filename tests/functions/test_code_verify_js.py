"""JavaScript's assert-style tests run in a sandbox of their own (``Sandbox.run_pair`` with
``functions/verifiers/js``): a program that reads fd 3, exits early, forges frames or binds
the names its tests trust gets no pass, and honest programs still pass. Real sandbox, no
mocks; uids from 400 000 up."""

from __future__ import annotations

import shutil

import pytest

from functions.verifiers.errors import InvalidTests
from functions.verifiers.sandbox import Limits
from functions.verifiers.verify import CodeTests, Verifier

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")

# node starts in 50-400 ms here, two of them per case; a loaded machine takes seconds
LIMITS = Limits(cpu_s=5, wall_s=15, memory_mb=256)
#: for a verdict that must come from the wall limit
SHORT = LIMITS.model_copy(update={"wall_s": 5})
BASE_UID = 400_000
ASSERT = "const assert = require('assert');\n"
TWO_ASSERTS = ASSERT + "assert.strictEqual(add(2, 3), 5);\nassert.strictEqual(add(1, 1), 2);\n"
#: a frame on the program's end of the channel (fd 4), written by the program itself
FRAME = (
    "const __w = (m) => { const b = Buffer.from(JSON.stringify(m)), h = Buffer.alloc(4);"
    " h.writeUInt32BE(b.length); require('fs').writeSync(4, Buffer.concat([h, b])); };\n"
)


@pytest.fixture
def verifier(pair_verifier):  # tests/functions/conftest.py: this module's BASE_UID and LIMITS
    return pair_verifier


def judge(verifier: Verifier, code: str, tests: str, limits: Limits | None = None):
    result = verifier.verify(code, CodeTests(test_code=tests), "javascript", limits=limits)
    assert result.total == 1
    return result.cases[0]


# -- forgeries ---------------------------------------------------------------------------------
FORGERIES = {
    # the old proof of a pass was a marker line on fd 3, read by a harness in the same process
    "exit_at_top_level": "function add(a, b) { return 0; }\nprocess.exit(0);\n",
    "exit_when_called": "function add(a, b) { process.exit(0); }\n",
    "read_fd3_when_called": (
        "function add(a, b) { const b2 = Buffer.alloc(80);"
        " require('fs').readSync(3, b2, 0, 80, null); process.stdout.write('\\n' + b2); process.exit(0); }\n"
    ),
    "print_a_marker": (
        "function add(a, b) { return 0; }\nconsole.log('rlfabric-tests-done-0123456789abcdef');\n"
    ),
    # patching the runtime of its own process patches nothing of the tests'
    "patch_assert": (
        "const assert = require('assert');\nfor (const k of Object.keys(assert)) assert[k] = () => {};\n"
        "process.exitCode = 0; process.on('exit', () => process.exit(0));\nfunction add(a, b) { return 0; }\n"
    ),
    "patch_globals": (
        "Object.is = () => true; Object.prototype.valueOf = () => 5;\nfunction add(a, b) { return 0; }\n"
    ),
    # a name the tests use and never declare: a module's name is only ever that module
    "its_own_assert": "const assert = { strictEqual() {}, ok() {} };\nfunction add(a, b) { return 0; }\n",
    # frames of its own on its end of the channel, before its server's
    "fake_frames": FRAME + "for (const m of [['hello'], ['ok', 5, []], ['ok', 2, []]]) __w(m);\n"
    "function add(a, b) { return 0; }\n",
    "fake_module": FRAME + "__w(['hello']); __w(['ok', ['mod', 'assert']]);\n"
    "function add(a, b) { return 0; }\n",
    "garbage_frame": "require('fs').writeSync(4, Buffer.from([0, 0, 0, 3, 0xff, 0xfe, 0xfd]));\n"
    "function add(a, b) { return a + b; }\n",
    "proto_pollution": FRAME + "__w(['hello']);\n"
    "__w(['ok', ['o', [['__proto__', ['o', [['strictEqual', 1]], false]]], false], []]);\n"
    "function add(a, b) { return 0; }\n",
}


@pytest.mark.parametrize("code", FORGERIES.values(), ids=FORGERIES.keys())
def test_forgeries_of_the_old_harness_fail(verifier, code):
    tests = TWO_ASSERTS
    if "const assert" in code:  # tests that take assert from the program
        tests = "assert.strictEqual(add(2, 3), 5);\n"
    case = judge(verifier, code, tests, SHORT)
    assert case.status != "Finished", case


def test_an_exit_swallowed_by_the_tests_still_fails(verifier):
    # the channel broke while test code caught every exception: the case fails all the same
    code = "function add(a, b) { process.exit(0); }\n"
    case = judge(verifier, code, "try { add(1, 2); } catch (e) {}\n")
    assert case.status == "Failed", case
    assert case.message == "exited before the tests ran to their end", case


def test_reading_fd_3_at_top_level_blocks_until_the_wall_limit(verifier):
    code = (
        "function add(a, b) { return 0; }\nconst b = Buffer.alloc(80);\n"
        "require('fs').readSync(3, b, 0, 80, null);\nprocess.stdout.write('\\n' + b);\nprocess.exit(0);\n"
    )
    case = judge(verifier, code, TWO_ASSERTS, SHORT)
    assert (case.status, "wall limit" in case.message) == ("TimeLimitExceeded", True), case


def test_a_promise_the_program_never_lets_settle_is_not_a_pass(verifier):
    # node exits 0 when nothing is left to run, with the code after the await never run
    tests = ASSERT + "(async () => {\n  if (add(2, 3) !== 5) await new Promise(() => {});\n})();\n"
    wrong = judge(verifier, "function add(a, b) { return 0; }\n", tests)
    assert wrong.status == "Failed", wrong
    assert wrong.message.startswith("the tests did not run to their end"), wrong
    right = judge(verifier, "function add(a, b) { return a + b; }\n", tests)
    assert right.status == "Finished", right


def test_a_thenable_of_the_program_cannot_stall_an_await(verifier):
    code = "function get() { return { then(resolve) {} }; }\n"
    case = judge(verifier, code, ASSERT + "(async () => { await get(); assert.fail('ran'); })();\n")
    assert (case.status, "cannot be passed to the program" in case.message) == ("RuntimeError", True), case


def test_a_function_of_the_tests_cannot_be_passed(verifier):
    code = "function apply(f, x) { return f(x); }\n"
    case = judge(verifier, code, ASSERT + "assert.strictEqual(apply((x) => x + 1, 1), 2);\n")
    assert case.status == "RuntimeError", case
    assert "a function (anonymous) of the tests cannot be passed to the program" in case.message


def test_flooding_the_channel_is_cut_off(verifier):
    code = (
        "const h = Buffer.alloc(4); h.writeUInt32BE(15 << 20); require('fs').writeSync(4, h);\n"
        "const chunk = Buffer.alloc(65536, 91); for (;;) require('fs').writeSync(4, chunk);\n"
    )
    case = judge(verifier, code, TWO_ASSERTS, LIMITS.model_copy(update={"channel_bytes": 1 << 20}))
    assert (case.status, case.message) == (
        "RuntimeError",
        "sent its tests more than the 1048576-byte channel cap",
    ), case


def test_the_program_ending_first_gets_its_own_verdict(verifier):
    crash = judge(verifier, "function add(a, b) { return a + b; }\nnull.x;\n", TWO_ASSERTS)
    assert (crash.status, crash.message) == ("RuntimeError", "exited with code 1"), crash
    assert "TypeError" in crash.stderr
    spin = judge(verifier, "function add(a, b) { for (;;); }\n", TWO_ASSERTS, SHORT)
    assert spin.status == "TimeLimitExceeded", spin


# -- tests that cannot judge a program ---------------------------------------------------------
def test_tests_that_never_use_the_program_are_invalid(verifier):
    # MultiPL-E's shape, with the call to test() left out: it passed every program
    tests = ASSERT + (
        "function test() {\n  const candidate = add;\n  assert.deepEqual(candidate(2, 3), 5);\n}\n"
    )
    with pytest.raises(InvalidTests, match="never used the program"):
        judge(verifier, "function add(a, b) { return 0; }\n", tests)
    with pytest.raises(InvalidTests, match="SyntaxError"):
        judge(verifier, "function add(a, b) { return a + b; }\n", ASSERT + "assert.ok(add(1, 2)")


# -- honest programs ---------------------------------------------------------------------------
HONEST = {
    "multipl_e": (
        "function add(x, y) { return x + y; }\n",
        "const assert = require('node:assert');\n\nfunction test() {\n  let candidate = add;\n"
        "  assert.deepEqual(candidate(0, 1), 1);\n  assert.deepEqual(candidate(5, 7), 12);\n}\n\ntest();\n",
    ),
    "its_assert_module": (  # the tests forgot to require assert; the program's is that module
        "const assert = require('assert');\nfunction add(a, b) { return a + b; }\n",
        "assert.strictEqual(add(2, 3), 5);\n",
    ),
    "state": (
        "let counter = 0;\nfunction inc() { return ++counter; }\n"
        "const box = { n: 0, bump() { return ++this.n; } };\n"
        "function makeStack() {\n  const items = [];\n"
        "  return { push: (x) => items.push(x), pop: () => items.pop() };\n}\n",
        ASSERT + "inc(); inc();\nassert.strictEqual(counter, 2);\n"
        "counter = 10;\nassert.strictEqual(inc(), 11);\n"
        "box.bump();\nassert.strictEqual(box.bump(), 2);\nassert.strictEqual(box.n, 2);\n"
        "const s = makeStack(); s.push(1); s.push(2);\nassert.strictEqual(s.pop(), 2);\n",
    ),
    "classes": (
        "class Animal {\n  constructor(n) { this.name = n; }\n"
        "  speak() { return `${this.name} makes a sound`; }\n}\n"
        "class Dog extends Animal { speak() { return `${this.name} barks`; } }\n"
        "class Stack extends Array { peek() { return this[this.length - 1]; } }\n"
        "class P {\n  constructor(x) { this.x = x; }\n"
        "  valueOf() { return this.x; }\n  toString() { return `P(${this.x})`; }\n}\n",
        ASSERT + "const d = new Dog('Rex');\nassert.strictEqual(d.speak(), 'Rex barks');\n"
        "assert(d instanceof Animal && d instanceof Dog && !(new Animal('a') instanceof Dog));\n"
        "assert.deepStrictEqual(new Dog('a'), new Dog('a'));\n"
        "assert.notDeepStrictEqual(new Dog('a'), { name: 'a' });\n"
        "const s = new Stack(); s.push(1, 2, 3);\nassert.strictEqual(s.peek(), 3);\n"
        "assert.deepStrictEqual([...s], [1, 2, 3]);\nassert(Array.isArray(s));\n"
        "assert.strictEqual(new P(2) + 1, 3);\nassert.strictEqual(`${new P(2)}`, 'P(2)');\n",
    ),
    "errors": (
        "function root(x) { if (x < 0) throw new RangeError('negative'); return Math.sqrt(x); }\n"
        "class ValidationError extends TypeError {\n"
        "  constructor(m) { super(m); this.name = 'ValidationError'; }\n}\n"
        "function check() { throw new ValidationError('bad'); }\nfunction raw() { throw 'text'; }\n",
        ASSERT + "assert.throws(() => root(-1), RangeError);\nassert.throws(() => root(-1), /negative/);\n"
        "assert.throws(() => check(), ValidationError);\nassert.throws(() => check(), TypeError);\n"
        "assert.throws(() => check(), { name: 'ValidationError', message: 'bad' });\n"
        "try { raw(); assert.fail('no throw'); } catch (e) { assert.strictEqual(e, 'text'); }\n",
    ),
    "values": (
        "function v() {\n  return { big: 10n ** 30n, neg0: -0, nan: NaN, inf: -Infinity, u: undefined,\n"
        "    d: new Date(5), s: new Set([1, 'a']), m: new Map([[1, [2]]]), re: /a+/gi,\n"
        "    ta: new Int32Array([1, -2]), buf: Buffer.from('hi'),\n"
        "    nested: [[1, [2, [3]]]], text: 'ünï' };\n}\n"
        "function grid() { const row = [0, 0]; return [row, row]; }\n",
        ASSERT + "assert.deepStrictEqual(v(), { big: 10n ** 30n, neg0: -0, nan: NaN, inf: -Infinity,"
        " u: undefined, d: new Date(5), s: new Set([1, 'a']), m: new Map([[1, [2]]]), re: /a+/gi,"
        " ta: new Int32Array([1, -2]), buf: Buffer.from('hi'), nested: [[1, [2, [3]]]], text: 'ünï' });\n"
        "assert.deepStrictEqual(grid(), [[0, 0], [0, 0]]);\n",
    ),
    "mutated_arguments": (
        "function sortInPlace(a) { a.sort((x, y) => x - y); }\n"
        "function count(m, k) { m.set(k, (m.get(k) || 0) + 1); }\nfunction fill(o) { o.a = 1; }\n",
        ASSERT + "const a = [3, 1, 2]; sortInPlace(a);\nassert.deepStrictEqual(a, [1, 2, 3]);\n"
        "const m = new Map(); count(m, 'x'); count(m, 'x');\nassert.strictEqual(m.get('x'), 2);\n"
        "const o = {}; fill(o);\nassert.deepStrictEqual(o, { a: 1 });\n",
    ),
    "async_and_generators": (
        "async function later(x) { await new Promise((r) => setTimeout(r, 5)); return x * 2; }\n"
        "async function fails() { throw new TypeError('nope'); }\n"
        "function* range(n) { for (let i = 0; i < n; i++) yield i; }\n",
        ASSERT + "assert.deepStrictEqual(Array.from(range(4)), [0, 1, 2, 3]);\n"
        "(async () => {\n  assert.strictEqual(await later(4), 8);\n"
        "  await assert.rejects(fails(), TypeError);\n})();\n",
    ),
    "strict_main_module": (
        "function add(a, b) { return a + b; }\n",
        "'use strict';\nconst assert = require('assert');\n"
        "if (require.main === module) { assert.strictEqual(add(1, 2), 3); }\n",
    ),
    "prints": (
        "console.log('loaded');\nfunction add(a, b) { console.error('add', a, b); return a + b; }\n",
        TWO_ASSERTS + "console.log('tests done');\n",
    ),
}


@pytest.mark.parametrize(("code", "tests"), HONEST.values(), ids=HONEST.keys())
def test_honest_programs_pass(verifier, code, tests):
    case = judge(verifier, code, tests)
    assert case.status == "Finished", case


def test_what_the_case_shows(verifier):
    # stdout: what the program printed (stdout and stderr); stderr: the tests' end
    wrong = judge(
        verifier,
        "console.log('hello from the program');\nfunction add(a, b) { return 0; }\n",
        "console.log('hello from the tests');\n" + TWO_ASSERTS,
    )
    assert (wrong.status, wrong.message) == ("Failed", "an assertion failed"), wrong
    assert "hello from the program" in wrong.stdout and "hello from the tests" not in wrong.stdout
    assert "hello from the tests" in wrong.stderr and "AssertionError" in wrong.stderr
    raised = judge(verifier, "function add(a, b) { return a.b.c; }\n", TWO_ASSERTS)
    assert raised.status == "RuntimeError", raised
    assert raised.message.startswith("the tests stopped on TypeError"), raised
