// The program's side of JavaScript assert-style tests: once the program's top-level code
// ran, answer the tests' requests about its names and objects (rpc_wire.js has the wire).
//
// main.js is the program with one line appended, which calls serve() with a function that
// evaluates a name in the program's own module scope (so its const, let, class and function
// declarations are all reachable). This runs in the program's process, so the program can
// rewrite any of it: nothing here is trusted. It only has to be right for an honest program;
// what the tests believe is decided in the tests' process.
'use strict';

const wire = require('./rpc_wire.js');
const { builtinModules } = require('module');

const NAME = /^[\p{ID_Start}$_][\p{ID_Continue}$\u200c\u200d]*$/u;

class Server {
  constructor(scope) {
    this.scope = scope; // (name, value, assign) => the name's value, in the program's scope
    this.objects = []; // handle -> object
    this.handles = new Map(); // object -> handle
  }

  encode(v) {
    return new wire.Encoder((x) => this.handle(x), { methodsStay: true }).encode(v);
  }

  decode(x) {
    return new wire.Decoder((h) => {
      if (h[0] !== 'h' || !Number.isInteger(h[1]) || h[1] < 0 || h[1] >= this.objects.length) {
        throw new TypeError(`not a handle: ${wire.brief(h)}`);
      }
      return this.objects[h[1]];
    }).decode(x);
  }

  handle(v) {
    let n = this.handles.get(v);
    if (n === undefined) {
      n = this.objects.length;
      this.objects.push(v);
      this.handles.set(v, n);
    }
    const kind = typeof v === 'function' ? 'f' : Array.isArray(v) ? 'a' : 'o';
    let label = '';
    try {
      label = String((typeof v === 'function' ? v.name : v.constructor && v.constructor.name) || '');
    } catch {}
    return ['h', n, kind, label.slice(0, 100)];
  }

  lookup(name, value, assign) {
    if (typeof name !== 'string' || !NAME.test(name) || name.startsWith('__rlfabric')) {
      throw new ReferenceError(`${String(name).slice(0, 100)} is not defined`);
    }
    const v = this.scope(name, value, assign);
    if (!assign && builtinModules.includes(name)) {
      // `const assert = require('assert')`: the tests bind their own module of that name
      for (const m of [name, `${name}/strict`]) {
        if (builtinModules.includes(m) && v === require(m)) return ['mod', m];
      }
    }
    return assign ? ['u'] : this.encode(v);
  }

  async answer(req) {
    try {
      const [op, ...args] = req;
      let result;
      let changed = [];
      if (op === 'lookup') return ['ok', this.lookup(args[0])];
      if (op === 'assign') {
        this.lookup(args[0], this.decode(args[1]), true);
        return ['ok', ['u']];
      }
      const obj = this.decode(args[0]);
      switch (op) {
        case 'call': case 'new': {
          const raw = args[op === 'call' ? 2 : 1];
          const argv = this.decode(raw);
          result = op === 'call' ? Reflect.apply(obj, this.decode(args[1]), argv) : Reflect.construct(obj, argv);
          changed = this.changed(raw[1], argv);
          break;
        }
        case 'get': result = obj[wire.decodeKey(args[1])]; break;
        case 'set': obj[wire.decodeKey(args[1])] = this.decode(args[2]); break;
        case 'del': result = delete obj[wire.decodeKey(args[1])]; break;
        case 'has': result = wire.decodeKey(args[1]) in obj; break;
        case 'keys': result = Reflect.ownKeys(obj).map(wire.encodeKey).filter((k) => k !== undefined); break;
        case 'desc': {
          const d = Reflect.getOwnPropertyDescriptor(obj, wire.decodeKey(args[1]));
          // an accessor is read through its getter: the tests see a value
          result = d === undefined ? null : [obj[wire.decodeKey(args[1])], 'value' in d ? d.writable : true, d.enumerable];
          break;
        }
        case 'proto': { // a handle even where the prototype is a plain object (a class's)
          const proto = Object.getPrototypeOf(obj);
          return ['ok', proto === null ? null : this.handle(proto), []];
        }
        case 'instanceof': result = obj instanceof this.decode(args[1]); break;
        default: throw new TypeError(`unknown request ${wire.brief(op)}`);
      }
      if (result instanceof Promise) {
        try {
          return ['ok', ['p', 'ok', this.encode(await result)], changed];
        } catch (e) {
          return ['ok', ['p', 'err', this.error(e)], changed];
        }
      }
      return ['ok', op === 'keys' ? result : this.encode(result), changed];
    } catch (e) {
      return ['err', this.error(e)];
    }
  }

  // The arguments a call mutated, re-encoded (the tests passed copies).
  changed(raw, now) {
    const out = [];
    if (!Array.isArray(raw)) return out;
    raw.forEach((before, i) => {
      if (Array.isArray(before) && typeof before[0] === 'string' && before[0] !== 'h') {
        const after = this.encode(now[i]);
        if (JSON.stringify(after) !== JSON.stringify(before)) out.push([i, after]);
      }
    });
    return out;
  }

  error(e) {
    let value;
    try {
      value = this.encode(e);
    } catch {
      value = ['u'];
    }
    if (!(e instanceof Error)) return [null, '', '', '', value];
    let base = '';
    for (let p = Object.getPrototypeOf(e); p; p = Object.getPrototypeOf(p)) {
      const name = p.constructor && p.constructor.name;
      if (Object.hasOwn(wire.ERRORS, name) && wire.ERRORS[name] === p.constructor) {
        base = name;
        break;
      }
    }
    const text = (x, n) => {
      try {
        return String(x).slice(0, n);
      } catch {
        return '(unprintable)';
      }
    };
    return [text(e.name, 100), text(e.message, 2000), text(e.stack, 4000), base, value];
  }
}

async function serve(scope) {
  const server = new Server(scope);
  wire.send(['hello']);
  for (;;) {
    const req = wire.recv();
    if (req === null) return;
    let reply = await server.answer(req);
    try {
      wire.send(reply);
    } catch (e) {
      if (e instanceof wire.ChannelError) throw e;
      reply = ['err', server.error(e)]; // over the frame limit: said instead of the value
      wire.send(reply);
    }
  }
}

module.exports = { serve };
