// The tests' side of JavaScript assert-style tests (trusted): run tests.js with the
// program's names bound to proxies, in a process of its own; its exit status is the
// verdict (the exit codes of functions/verifiers/rpc.py).
//
// The program runs in another sandbox and answers requests over the channel (rpc_wire.js).
// Nothing it sends is code: values arrive as data built here, and its objects and functions
// as proxies whose every operation is a request. The tests' own values reach it only when
// test code hands them over (a call's arguments, a property set); comparisons of what it
// returned are the tests' own code. Functions of the tests cannot be passed to it.
'use strict';

const assert = require('assert');
const asyncHooks = require('async_hooks');
const fs = require('fs');
const { builtinModules } = require('module');
const path = require('path');
const util = require('util');
const vm = require('vm');
const wire = require('./rpc_wire.js');

const PASSED = 0;
const ASSERTION_FAILED = 10;
const TESTS_RAISED = 11;
const PROTOCOL_ERROR = 12;
const PROGRAM_GONE = 13;
const TESTS_INVALID = 14;
const UNFINISHED = 15;
const TESTS = process.argv[2] || 'tests.js';
// the parameters of the function the tests run in: module-level names of a CommonJS file
const PARAMS = ['require', 'module', 'exports', '__filename', '__dirname'];
const ERROR_BASES = new Set(Object.keys(wire.ERRORS));

let channelError = null; // sticky: test code that swallows it still fails
let usedProgram = false; // a lookup of one of its names: else the tests judged nothing

// -- requests ---------------------------------------------------------------------------------
function request(message) {
  if (channelError !== null) throw channelError;
  let reply;
  try {
    wire.send(message);
    reply = wire.recv();
    if (reply === null) throw new wire.ProgramGone('the program exited before it answered');
    if (!Array.isArray(reply) || (reply[0] !== 'ok' && reply[0] !== 'err')) {
      throw new wire.ProtocolError(`not a reply: ${wire.brief(reply)}`);
    }
  } catch (e) {
    throw fail(e);
  }
  return reply;
}

function fail(e) {
  if (e instanceof wire.ChannelError && channelError === null) channelError = e;
  return e;
}

// The value of a reply, or what it throws; `changed` gets the mutated arguments.
function result(reply, args) {
  try {
    if (reply[0] === 'err') {
      if (reply.length !== 2) throw new wire.ProtocolError('a malformed error reply');
      throw remoteError(reply[1]);
    }
    if (reply.length !== 3 && reply.length !== 2) throw new wire.ProtocolError('a malformed reply');
    const value = reply[1];
    if (Array.isArray(value) && value[0] === 'p') {
      const [, state, payload] = value;
      if (value.length !== 3 || (state !== 'ok' && state !== 'err')) throw new wire.ProtocolError('a malformed promise');
      writeBack(args, reply[2]);
      return state === 'ok' ? Promise.resolve(decode(payload)) : Promise.reject(remoteError(payload));
    }
    const out = decode(value);
    writeBack(args, reply[2]);
    return out;
  } catch (e) {
    throw fail(e);
  }
}

// An exception of the program, rebuilt here: a builtin error of that name, or a
// RemoteError that derives from the builtin error class the program's derived from (so
// `assert.throws(f, TypeError)` works); it keeps a handle to the program's own object.
const REMOTE = Symbol('rlfabric.remote');
const remoteClasses = new Map();
function remoteError(x) {
  if (!Array.isArray(x) || x.length !== 5) throw new wire.ProtocolError(`a malformed error: ${wire.brief(x)}`);
  const [name, message, stack, base, value] = x;
  const thrown = decode(value);
  if (name === null) return thrown; // `throw "text"`: the value itself
  for (const s of [name, message, stack, base]) {
    if (typeof s !== 'string') throw new wire.ProtocolError('a malformed error');
  }
  const Base = ERROR_BASES.has(base) ? wire.ERRORS[base] : Error;
  let e;
  if (name === base && ERROR_BASES.has(name)) {
    e = new Base(message);
  } else {
    let Cls = remoteClasses.get(Base);
    if (Cls === undefined) {
      Cls = class RemoteError extends Base {};
      remoteClasses.set(Base, Cls);
    }
    e = new Cls(message);
    Object.defineProperty(e, 'name', { value: name, writable: true, configurable: true });
  }
  e.stack = `${name}: ${message}\n    (raised in the program)\n${stack.split('\n').slice(1).join('\n')}`;
  if (proxyHandles.has(thrown)) Object.defineProperty(e, REMOTE, { value: thrown });
  return e;
}

// -- values -----------------------------------------------------------------------------------
const proxies = new Map(); // handle -> its proxy (one object, one proxy)
const proxyHandles = new WeakMap(); // proxy -> handle

function decode(x, allowModule = null) {
  return new wire.Decoder((h) => {
    if (h[0] === 'mod') {
      // only as the value of a name, and only the tests' own module of that name
      const m = h[1];
      if (h.length !== 2 || allowModule === null || typeof m !== 'string' || !builtinModules.includes(m) || m.split('/')[0] !== allowModule) {
        throw new wire.ProtocolError(`a module where none can be: ${wire.brief(h)}`);
      }
      return require(m);
    }
    const [, n, kind, label] = h;
    if (h.length !== 4 || !Number.isSafeInteger(n) || n < 0 || !['f', 'o', 'a'].includes(kind) || typeof label !== 'string') {
      throw new wire.ProtocolError(`a malformed handle: ${wire.brief(h)}`);
    }
    return proxyFor(n, kind, label.slice(0, 100));
  }).decode(x);
}

function encode(v) {
  return new wire.Encoder((x) => {
    if (proxyHandles.has(x)) return ['h', proxyHandles.get(x)];
    const what = typeof x === 'function' ? `a function (${x.name || 'anonymous'})` : `an object of class ${x.constructor && x.constructor.name}`;
    throw new TypeError(
      `${what} of the tests cannot be passed to the program, which runs in a process of its own: ` +
        'pass plain data (numbers, strings, arrays, plain objects, Map, Set, Date...) or its own objects',
    );
  }, { owned: (x) => proxyHandles.has(x) }).encode(v);
}

// Mutated arguments (the program got copies): the tests' own objects are updated in place.
function writeBack(args, changed) {
  if (changed === undefined || (Array.isArray(changed) && changed.length === 0)) return;
  if (!Array.isArray(changed) || args === undefined) throw new wire.ProtocolError('a malformed list of mutated arguments');
  for (const item of changed) {
    if (!Array.isArray(item) || item.length !== 2 || !Number.isInteger(item[0]) || item[0] < 0 || item[0] >= args.length) {
      throw new wire.ProtocolError('a malformed mutated argument');
    }
    const [i, enc] = item;
    const mine = args[i];
    const now = decode(enc);
    if (proxyHandles.has(mine) || proxyHandles.has(now)) throw new wire.ProtocolError(`argument ${i} is an object of the program`);
    if (Array.isArray(mine) && Array.isArray(now) && Object.getPrototypeOf(mine) === Array.prototype) {
      mine.length = 0;
      for (let k = 0; k < now.length; k++) mine.push(now[k]);
    } else if (mine instanceof Map && now instanceof Map) {
      mine.clear();
      for (const [k, v] of now) mine.set(k, v);
    } else if (mine instanceof Set && now instanceof Set) {
      mine.clear();
      for (const v of now) mine.add(v);
    } else if (mine instanceof Date && now instanceof Date) {
      mine.setTime(now.getTime());
    } else if (ArrayBuffer.isView(mine) && ArrayBuffer.isView(now) && mine.constructor === now.constructor && mine.length === now.length) {
      mine.set(now);
    } else if (mine !== null && typeof mine === 'object' && wire.isPlainObject(mine) && now !== null && typeof now === 'object' && wire.isPlainObject(now)) {
      for (const k of Object.keys(mine)) delete mine[k];
      for (const k of Object.keys(now)) {
        Object.defineProperty(mine, k, { value: now[k], writable: true, enumerable: true, configurable: true });
      }
    } else {
      throw new wire.ProtocolError(`argument ${i} came back as something else than it went`);
    }
  }
}

function key(k) {
  const enc = wire.encodeKey(k);
  if (enc === undefined) throw new TypeError('a symbol of the tests cannot be a key of the program\'s object');
  return enc;
}

// A function or object that stays in the program: every operation is a request. The
// target only gives the proxy its kind (callable, an array); what it reports is the
// program's. `instanceof` asks the program (its classes' instances are its objects).
function proxyFor(n, kind, label) {
  let p = proxies.get(n);
  if (p !== undefined) return p;
  let target;
  if (kind === 'f') target = { [label]: function () {} }[label].bind(); // callable, no own prototype
  else if (kind === 'a') target = [];
  else target = new ({ [label || 'Object']: class {} })[label || 'Object']();
  const h = ['h', n];
  p = new Proxy(target, {
    get(t, k) {
      if (k === Symbol.hasInstance && kind === 'f') return hasInstance(h);
      let enc;
      try {
        enc = key(k);
      } catch {
        return undefined;
      }
      return result(request(['get', h, enc]));
    },
    set(t, k, v) {
      result(request(['set', h, key(k), encode(v)]));
      return true;
    },
    has(t, k) {
      const enc = wire.encodeKey(k);
      return enc === undefined ? false : result(request(['has', h, enc])) === true;
    },
    deleteProperty(t, k) {
      return result(request(['del', h, key(k)])) === true;
    },
    ownKeys(t) {
      const reply = request(['keys', h]);
      if (reply[0] === 'err') return result(reply);
      let keys;
      try {
        if (!Array.isArray(reply[1]) || reply[1].length > wire.MAX_ITEMS) throw new wire.ProtocolError('a malformed list of keys');
        keys = [...new Set(reply[1].map((x) => wire.decodeKey(x)))];
      } catch (e) {
        throw fail(e);
      }
      if (kind === 'a' && !keys.includes('length')) keys.push('length'); // the target's, unconfigurable
      return keys;
    },
    getOwnPropertyDescriptor(t, k) {
      const enc = wire.encodeKey(k);
      if (enc === undefined) return undefined;
      const d = result(request(['desc', h, enc]));
      if (d === null) {
        if (kind === 'a' && k === 'length') throw new wire.ProtocolError('an array without a length');
        return undefined;
      }
      if (!Array.isArray(d) || d.length !== 3 || typeof d[1] !== 'boolean' || typeof d[2] !== 'boolean') {
        throw fail(new wire.ProtocolError('a malformed property descriptor'));
      }
      if (kind === 'a' && k === 'length') {
        if (typeof d[0] !== 'number') throw fail(new wire.ProtocolError('an array length that is not a number'));
        return { value: d[0], writable: true, enumerable: false, configurable: false };
      }
      return { value: d[0], writable: d[1], enumerable: d[2], configurable: true };
    },
    defineProperty(t, k, d) {
      if (!('value' in d)) throw new TypeError('only data properties can be defined on the program\'s objects');
      result(request(['set', h, key(k), encode(d.value)]));
      return true;
    },
    getPrototypeOf() {
      const proto = result(request(['proto', h]));
      if (proto !== null && !proxyHandles.has(proto)) throw fail(new wire.ProtocolError('a prototype that is not an object'));
      return proto;
    },
    setPrototypeOf() {
      return false;
    },
    preventExtensions() {
      return false; // the target stays extensible: the program's answers are not bound by it
    },
    apply(t, self, args) {
      const enc = encode(args);
      const me = self === scope ? undefined : self; // a name of the program called as a function
      return result(request(['call', h, encode(me), enc]), args);
    },
    construct(t, args) {
      return result(request(['new', h, encode(args)]), args);
    },
  });
  proxies.set(n, p);
  proxyHandles.set(p, n);
  return p;
}

function hasInstance(h) {
  return (v) => {
    const mine = !proxyHandles.has(v) && v instanceof Error && Object.hasOwn(v, REMOTE) ? v[REMOTE] : v;
    if (!proxyHandles.has(mine)) return false; // the tests' values are never the program's instances
    return result(request(['instanceof', ['h', proxyHandles.get(mine)], h])) === true;
  };
}

// -- the program's names --------------------------------------------------------------------
// What test code names but does not declare comes from the program (its top-level const,
// let, class, function and var), except the tests' own globals and module names, and a
// name of a builtin module, which is only ever the tests' own module of that name.
const functions = new Map(); // function names, looked up once (the program may not rebind them)
let looked = null; // the lookup just made by `has`, for the `get` that follows it
const scope = new Proxy(Object.create(null), {
  has(t, k) {
    if (typeof k !== 'string' || Object.hasOwn(globalThis, k) || PARAMS.includes(k) || k.startsWith('__rlfabric')) return false;
    if (functions.has(k)) return true;
    usedProgram = true;
    const reply = request(['lookup', k]);
    looked = { k, reply };
    if (reply[0] === 'err') return !(Array.isArray(reply[1]) && reply[1][0] === 'ReferenceError');
    if (builtinModules.includes(k) && !(Array.isArray(reply[1]) && reply[1][0] === 'mod')) {
      looked = null;
      return false; // a module's name that is not that module: not bound
    }
    return true;
  },
  get(t, k) {
    if (k === Symbol.unscopables || typeof k !== 'string') return undefined;
    if (functions.has(k)) return functions.get(k);
    let reply;
    if (looked !== null && looked.k === k) {
      reply = looked.reply;
      looked = null;
    } else {
      reply = request(['lookup', k]);
    }
    if (reply[0] === 'err') return result(reply);
    let v;
    try {
      v = decode(reply[1], k);
    } catch (e) {
      throw fail(e);
    }
    if (typeof v === 'function' && proxyHandles.has(v)) functions.set(k, v);
    return v;
  },
  set(t, k, v) {
    looked = null;
    functions.delete(k);
    result(request(['assign', k, encode(v)]));
    return true;
  },
});

// -- the run ----------------------------------------------------------------------------------
function describe(e) {
  let text;
  try {
    text = e instanceof Error ? util.inspect(e) : `Uncaught ${util.inspect(e)}`;
  } catch {
    text = 'an exception that cannot be printed';
  }
  let last;
  try {
    const name = e instanceof Error ? String(e.name) : 'Uncaught';
    const message = e instanceof Error ? String(e.message) : util.inspect(e);
    last = `${name}: ${message.split('\n').find((l) => l.trim()) || ''}`.slice(0, 300);
  } catch {
    last = 'an exception that cannot be printed';
  }
  return `${text}\n${last}\n`;
}

function finish(e) {
  if (channelError !== null) e = channelError;
  let code = TESTS_RAISED;
  if (e instanceof wire.ProgramGone) code = PROGRAM_GONE;
  else if (e instanceof wire.ChannelError) code = PROTOCOL_ERROR;
  else if (e instanceof assert.AssertionError) code = ASSERTION_FAILED;
  fs.writeSync(2, describe(e));
  process.exit(code);
}

function main() {
  let source = fs.readFileSync(TESTS, 'utf8');
  if (source.startsWith('#!')) source = `//${source.slice(2)}`;
  let run;
  try {
    // one line of wrapper, so the tests' line numbers are their own
    const wrapped = `(function (${PARAMS.join(', ')}, __rlfabric_scope) { with (__rlfabric_scope) { return (function () {${source}\n}).call(this); } })`;
    run = new vm.Script(wrapped, { filename: TESTS }).runInThisContext();
  } catch (e) {
    fs.writeSync(2, `the tests do not compile: ${describe(e)}`);
    process.exit(TESTS_INVALID);
  }
  let hello;
  try {
    hello = wire.recv();
  } catch (e) {
    finish(e);
  }
  if (hello === null) finish(new wire.ProgramGone('the program ended before its tests began'));
  if (!Array.isArray(hello) || hello[0] !== 'hello') finish(new wire.ProtocolError(`not a hello: ${wire.brief(hello)}`));

  process.on('uncaughtException', finish);
  process.on('exit', (code) => {
    if (code !== PASSED) return;
    if (channelError !== null) {
      fs.writeSync(2, describe(channelError));
      process.exitCode = channelError instanceof wire.ProgramGone ? PROGRAM_GONE : PROTOCOL_ERROR;
    } else if (!usedProgram) {
      fs.writeSync(2, 'the tests never used the program: they ran nothing that could tell a right one from a wrong one (call the test functions they define)\n');
      process.exitCode = TESTS_INVALID;
    }
  });
  // a promise of the tests that never settled when nothing is left to run: code after an
  // `await` on it never ran, so the tests did not run to their end
  const pending = new Set();
  asyncHooks
    .createHook({
      init(id, type) {
        if (type === 'PROMISE') pending.add(id);
      },
      promiseResolve(id) {
        pending.delete(id);
      },
    })
    .enable();
  process.on('beforeExit', () => {
    if (pending.size > 0 && channelError === null) {
      fs.writeSync(2, `the tests did not run to their end: ${pending.size} of their promises never settled\n`);
      process.exit(UNFINISHED);
    }
  });
  // the tests are the main module, as they were when appended to the program
  run.call(module.exports, require, module, module.exports, path.resolve(TESTS), process.cwd(), scope);
}

main();
