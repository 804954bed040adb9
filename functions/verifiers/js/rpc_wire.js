// The wire between a JavaScript program and its assert-style tests, which run in two
// sandboxes (functions/verifiers/rpc.py draws the picture; this is its JavaScript twin).
//
// Both runs load this file: the program's server (rpc_server.js, untrusted: the program can
// rewrite anything in its own process) and the tests' harness (rpc_harness.js, trusted).
// Requests arrive on fd 3, frames leave on fd 4; fd 1 is the run's stderr, so nothing a
// run prints can be taken for a frame. A frame is a 4-byte big-endian length and a JSON
// body. Values are JSON, or a list whose first item is a tag:
//
//   ["u"] undefined     ["n", "NaN"|"Infinity"|"-Infinity"|"-0"]     ["bi", hex] a BigInt
//   ["a", [..]] an Array             ["o", [[key, v], ..], nullProto] a plain object
//   ["map", [[k, v], ..]]  ["set", [..]]  ["date", ms]  ["re", source, flags]
//   ["buf", base64] a Buffer   ["ta", type, base64] a typed array   ["ab", base64] an ArrayBuffer
//   ["sym", name] a well-known symbol (Symbol.iterator...)   ["symfor", key] Symbol.for(key)
//   ["h", n, kind, label]  an object that stays in the program, as handle n ("f" a function,
//                          "a" an array of a class of its own, "o" any other object)
//   ["mod", name]          (a name's lookup only) the builtin module of that name
//   ["p", "ok", v] | ["p", "err", error]   (a reply only) a promise, settled in the program
//
// Requests are [op, ...]; replies ["ok", value, changed] (changed: [[i, value], ..] the
// arguments a call mutated, which the tests passed as copies) or ["err", error] where error
// is [name or null, message, stack, builtin base, thrown value].
'use strict';

const fs = require('fs');

const MAX_FRAME = 16 << 20;
const MAX_DEPTH = 100;
const MAX_ITEMS = 1 << 20;
const IN = 3;
const OUT = 4;

class ChannelError extends Error {}
ChannelError.prototype.name = 'ChannelError';
class ProtocolError extends ChannelError {}
ProtocolError.prototype.name = 'ProtocolError';
class ProgramGone extends ChannelError {}
ProgramGone.prototype.name = 'ProgramGone';

function send(message) {
  const body = Buffer.from(JSON.stringify(message), 'utf8');
  if (body.length > MAX_FRAME) {
    throw new RangeError(`a value of ${body.length} bytes is over the ${MAX_FRAME}-byte limit of the channel`);
  }
  const frame = Buffer.allocUnsafe(4 + body.length);
  frame.writeUInt32BE(body.length, 0);
  body.copy(frame, 4);
  let off = 0;
  while (off < frame.length) {
    try {
      off += fs.writeSync(OUT, frame, off, frame.length - off);
    } catch (e) {
      if (e.code === 'EAGAIN') continue;
      throw new ProgramGone(`writing the channel: ${e.message}`);
    }
  }
}

function readExactly(n, eofOk) {
  const buf = Buffer.allocUnsafe(n);
  let off = 0;
  while (off < n) {
    let got;
    try {
      got = fs.readSync(IN, buf, off, n - off, null);
    } catch (e) {
      if (e.code === 'EAGAIN') continue;
      throw new ProgramGone(`reading the channel: ${e.message}`);
    }
    if (got === 0) {
      if (eofOk && off === 0) return null;
      throw new ProgramGone('the channel ended in the middle of a frame');
    }
    off += got;
  }
  return buf;
}

const utf8 = new TextDecoder('utf-8', { fatal: true });

// One frame; null at a clean end of the channel (EOF between frames).
function recv() {
  const head = readExactly(4, true);
  if (head === null) return null;
  const size = head.readUInt32BE(0);
  if (size > MAX_FRAME) throw new ProtocolError(`a frame of ${size} bytes announced, over the ${MAX_FRAME}-byte limit`);
  const body = size ? readExactly(size, false) : Buffer.alloc(0);
  try {
    return JSON.parse(utf8.decode(body));
  } catch (e) {
    throw new ProtocolError(`a frame that is not valid JSON (${e.name}: ${String(e.message).slice(0, 200)})`);
  }
}

const WELL_KNOWN = new Map(
  Object.getOwnPropertyNames(Symbol)
    .filter((n) => typeof Symbol[n] === 'symbol')
    .map((n) => [Symbol[n], n]),
);
const TYPED = {
  Int8Array, Uint8Array, Uint8ClampedArray, Int16Array, Uint16Array, Int32Array, Uint32Array,
  Float32Array, Float64Array, BigInt64Array, BigUint64Array,
};
const ERRORS = {
  Error, TypeError, RangeError, SyntaxError, ReferenceError, EvalError, URIError, AggregateError,
};

function isPlainObject(v) {
  const proto = Object.getPrototypeOf(v);
  return proto === Object.prototype || proto === null;
}

function b64(view) {
  return Buffer.from(view.buffer, view.byteOffset, view.byteLength).toString('base64');
}

// Turns a value into its JSON form. `handle(v)` is what happens to anything that is not
// plain data (an object of a class, a function): the program keeps it and sends a handle;
// the tests send the handles of the program's own objects and refuse anything else.
// `owned(v)`: v is a handle of the other side's (the tests' proxies), never looked into.
// `methodsStay`: a plain object with a function among its values (`{n: 0, inc() {..}}`)
// stays where it is, so its methods change the object itself and not a copy.
class Encoder {
  constructor(handle, { owned = null, methodsStay = false, maxItems = MAX_ITEMS } = {}) {
    this.handle = handle;
    this.owned = owned;
    this.methodsStay = methodsStay;
    this.items = 0;
    this.maxItems = maxItems;
    this.path = new Set(); // objects being encoded: a cycle stays a handle
  }

  encode(v, depth = 0) {
    if (++this.items > this.maxItems) throw new RangeError(`more than ${this.maxItems} values to send at once`);
    switch (typeof v) {
      case 'undefined': return ['u'];
      case 'boolean': case 'string': return v;
      case 'number':
        if (Object.is(v, -0)) return ['n', '-0'];
        return Number.isFinite(v) ? v : ['n', String(v)];
      case 'bigint': return ['bi', v.toString(16)];
      case 'symbol': {
        if (WELL_KNOWN.has(v)) return ['sym', WELL_KNOWN.get(v)];
        const key = Symbol.keyFor(v);
        if (key !== undefined) return ['symfor', key];
        throw new TypeError('a symbol of its own (not Symbol.for or a well-known one) cannot cross to the other run');
      }
      case 'function': return this.handle(v);
      default: break;
    }
    if (v === null) return null;
    if (this.owned !== null && this.owned(v)) return this.handle(v);
    if (depth >= MAX_DEPTH || this.path.has(v)) return this.handle(v);
    const data = this.data(v, depth + 1);
    return data === undefined ? this.handle(v) : data;
  }

  data(v, d) {
    const proto = Object.getPrototypeOf(v);
    this.path.add(v);
    try {
      if (Array.isArray(v) && proto === Array.prototype) {
        const out = new Array(v.length);
        for (let i = 0; i < v.length; i++) out[i] = this.encode(v[i], d);
        return ['a', out];
      }
      if (proto === Object.prototype || proto === null) {
        const keys = Object.keys(v);
        const values = keys.map((k) => v[k]);
        if (this.methodsStay && values.some((x) => typeof x === 'function')) return undefined;
        return ['o', keys.map((k, i) => [k, this.encode(values[i], d)]), proto === null];
      }
      if (proto === Map.prototype) return ['map', [...v].map(([k, x]) => [this.encode(k, d), this.encode(x, d)])];
      if (proto === Set.prototype) return ['set', [...v].map((x) => this.encode(x, d))];
      if (proto === Date.prototype) {
        const t = v.getTime();
        return ['date', Number.isNaN(t) ? 'NaN' : t];
      }
      if (proto === RegExp.prototype) return ['re', v.source, v.flags];
      if (proto === Buffer.prototype) return ['buf', b64(v)];
      if (proto === ArrayBuffer.prototype) return ['ab', Buffer.from(v).toString('base64')];
      for (const [name, T] of Object.entries(TYPED)) {
        if (proto === T.prototype) return ['ta', name, b64(v)];
      }
      return undefined;
    } finally {
      this.path.delete(v);
    }
  }
}

// Turns the JSON form back into values; anything malformed is a ProtocolError. `handle(x)`
// makes the object for ["h", ..] (and ["mod", ..] where the caller allows it).
class Decoder {
  constructor(handle) {
    this.handle = handle;
    this.items = 0;
  }

  decode(x, depth = 0) {
    if (++this.items > MAX_ITEMS) throw new ProtocolError(`more than ${MAX_ITEMS} values in one frame`);
    const t = typeof x;
    if (x === null || t === 'boolean' || t === 'string' || t === 'number') return x;
    if (!Array.isArray(x) || typeof x[0] !== 'string') throw new ProtocolError(`not a value of this protocol: ${brief(x)}`);
    if (depth > MAX_DEPTH) throw new ProtocolError(`values nested deeper than ${MAX_DEPTH}`);
    try {
      return this.tagged(x[0], x.slice(1), depth + 1);
    } catch (e) {
      if (e instanceof ChannelError) throw e;
      throw new ProtocolError(`a malformed ${JSON.stringify(x[0]).slice(0, 40)} value (${e.name}: ${String(e.message).slice(0, 200)})`);
    }
  }

  tagged(tag, args, d) {
    switch (tag) {
      case 'u': arity(args, 0); return undefined;
      case 'n': {
        const [s] = arity(args, 1);
        if (s === '-0') return -0;
        if (s === 'NaN' || s === 'Infinity' || s === '-Infinity') return Number(s);
        throw new TypeError(`${brief(s)} is not a non-finite number`);
      }
      case 'bi': {
        const [s] = arity(args, 1);
        if (typeof s !== 'string' || !/^-?[0-9a-f]+$/.test(s)) throw new TypeError('not a hex BigInt');
        return s[0] === '-' ? -BigInt(`0x${s.slice(1)}`) : BigInt(`0x${s}`);
      }
      case 'a': return list(arity(args, 1)[0]).map((v) => this.decode(v, d));
      case 'o': {
        const [pairs, nullProto] = arity(args, 2);
        const out = nullProto === true ? Object.create(null) : {};
        for (const p of list(pairs)) {
          const [k, v] = arity(list(p), 2);
          if (typeof k !== 'string') throw new TypeError('an object key that is not a string');
          // a data property even for "__proto__" (an assignment would set the prototype)
          Object.defineProperty(out, k, { value: this.decode(v, d), writable: true, enumerable: true, configurable: true });
        }
        return out;
      }
      case 'map': return new Map(list(arity(args, 1)[0]).map((p) => arity(list(p), 2).map((v) => this.decode(v, d))));
      case 'set': return new Set(list(arity(args, 1)[0]).map((v) => this.decode(v, d)));
      case 'date': {
        const [ms] = arity(args, 1);
        if (ms !== 'NaN' && typeof ms !== 'number') throw new TypeError('a date that is not a number');
        return new Date(ms === 'NaN' ? NaN : ms);
      }
      case 're': {
        const [source, flags] = arity(args, 2);
        return new RegExp(str(source), str(flags));
      }
      case 'buf': return Buffer.from(str(arity(args, 1)[0]), 'base64');
      case 'ab': {
        const raw = Buffer.from(str(arity(args, 1)[0]), 'base64');
        return raw.buffer.slice(raw.byteOffset, raw.byteOffset + raw.length);
      }
      case 'ta': {
        const [name, data] = arity(args, 2);
        if (!Object.hasOwn(TYPED, name)) throw new TypeError(`no typed array ${brief(name)}`);
        const raw = Buffer.from(str(data), 'base64');
        const T = TYPED[name];
        if (raw.length % T.BYTES_PER_ELEMENT) throw new TypeError('a typed array of a partial element');
        const copy = new Uint8Array(raw); // aligned, of its own
        return new T(copy.buffer, 0, raw.length / T.BYTES_PER_ELEMENT);
      }
      case 'sym': {
        const [name] = arity(args, 1);
        if (typeof name !== 'string' || typeof Symbol[name] !== 'symbol') throw new TypeError(`no well-known symbol ${brief(name)}`);
        return Symbol[name];
      }
      case 'symfor': return Symbol.for(str(arity(args, 1)[0]));
      case 'h': case 'mod': return this.handle([tag, ...args]);
      default: throw new TypeError(`unknown tag ${brief(tag)}`);
    }
  }
}

function arity(args, n) {
  if (args.length !== n) throw new TypeError(`${args.length} fields instead of ${n}`);
  return args;
}

function list(x) {
  if (!Array.isArray(x)) throw new TypeError(`expected a list, got ${brief(x)}`);
  return x;
}

function str(x) {
  if (typeof x !== 'string') throw new TypeError(`expected a string, got ${brief(x)}`);
  return x;
}

function brief(x) {
  try {
    return String(JSON.stringify(x)).slice(0, 80);
  } catch {
    return '?';
  }
}

// A property key on the wire: a string, or a well-known / registered symbol.
function encodeKey(key) {
  if (typeof key === 'string') return key;
  if (WELL_KNOWN.has(key)) return ['sym', WELL_KNOWN.get(key)];
  const name = Symbol.keyFor(key);
  return name === undefined ? undefined : ['symfor', name];
}

function decodeKey(x) {
  if (typeof x === 'string') return x;
  const key = new Decoder(() => {
    throw new TypeError('a handle as a key');
  }).decode(x);
  if (typeof key !== 'symbol') throw new ProtocolError(`a property key that is not a string or symbol: ${brief(x)}`);
  return key;
}

module.exports = {
  MAX_FRAME, MAX_DEPTH, MAX_ITEMS, ChannelError, ProtocolError, ProgramGone, send, recv,
  Encoder, Decoder, ERRORS, isPlainObject, encodeKey, decodeKey, brief,
};
