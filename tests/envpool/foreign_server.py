"""A session-protocol server written without envpool, as one in another language would be:
length-prefixed JSON frames by hand. It plays a one-step echo episode and breaks the
protocol in one way, named on its command line (``python foreign_server.py SOCK MODE``):

    good            nothing wrong
    open-info       the open's result is a string, not an object
    ok-not-bool     the reset's reply says ``"ok": 1``
    wrong-id        the reset is answered under another request's id
    error-shape     the reset fails with ``"error": "boom"`` (not an object)
    no-result       the reset's reply is ok but carries no result
    reset-shape     the reset's result has no ``obs``
    step-shape      the step's reward is ``"lots"``
    step-error      the step fails with a ValueError and says nothing of its soundness
    stray-reply     the reset is answered, then (in the same write) a reply to an id never
                    sent arrives while nothing waits
    step-print      the step writes a debug line to the session socket before its reply: the
                    line's first 4 bytes read as a length far over the frame limit
    step-not-json   the step's reply is a frame whose body is Python's repr of a dict, not JSON
    step-huge       the step's reply is a well-formed frame of a JSON object over the 16 MiB
                    frame limit (an observation too big, sent whole)
    step-then-print the step's reply, then (in the same write) a debug line: the reply is
                    whole, what follows it is not a frame
    open-print      the open is answered by a printed line, not a frame
    print-after-reset  once the reset is answered and a line comes on its stdin (the test's
                    go: nothing waits for a reply then), a printed line
"""

import json
import os
import socket
import struct
import sys


def send(conn: socket.socket, msg: dict) -> None:
    body = json.dumps(msg).encode()
    conn.sendall(struct.pack("!I", len(body)) + body)


def recv(conn: socket.socket) -> dict:
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    (size,) = struct.unpack("!I", exact(4))
    return json.loads(exact(size))


def reply(mode: str, msg: dict, steps: int) -> dict:
    rid, op = msg.get("id"), msg.get("op")
    if op == "reset":
        result = {"obs": {"text": "ready"}, "info": {}}
        if mode == "ok-not-bool":
            return {"id": rid, "ok": 1, "result": result}
        if mode == "wrong-id":
            return {"id": rid + 1000, "ok": True, "result": result}
        if mode == "error-shape":
            return {"id": rid, "ok": False, "error": "boom"}
        if mode == "no-result":
            return {"id": rid, "ok": True}
        if mode == "reset-shape":
            return {"id": rid, "ok": True, "result": {"observation": "ready"}}
        return {"id": rid, "ok": True, "result": result}
    if op == "step":
        if mode == "step-error":
            return {"id": rid, "ok": False, "error": {"type": "ValueError", "message": "no such move"}}
        reward = "lots" if mode == "step-shape" else 1.0
        action = (msg.get("args") or {}).get("action")
        result = {"obs": {"text": f"{action} #{steps}"}, "reward": reward, "terminated": False}
        return {"id": rid, "ok": True, "result": result}
    return {"id": rid, "ok": True, "result": None}  # ping, close


def main() -> None:
    path, mode = sys.argv[1], sys.argv[2]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        try:
            msg = recv(conn)
            info = "hello" if mode == "open-info" else {"pid": os.getpid(), "deterministic": True}
            if mode == "open-print":
                conn.sendall(b"starting up...\n")
            else:
                send(conn, {"id": 0, "ok": True, "result": info})
            steps = 0
            while True:
                msg = recv(conn)
                steps += msg.get("op") == "step"
                out = reply(mode, msg, steps)
                if mode == "step-print" and msg.get("op") == "step":
                    conn.sendall(b"DEBUG stepping with " + repr(msg.get("args")).encode() + b"\n")
                if mode == "step-not-json" and msg.get("op") == "step":
                    body = repr(out).encode()
                    conn.sendall(struct.pack("!I", len(body)) + body)
                    continue
                if mode == "step-then-print" and msg.get("op") == "step":
                    body = json.dumps(out).encode()
                    conn.sendall(struct.pack("!I", len(body)) + body + b"DEBUG stepped\n")
                    continue
                if mode == "step-huge" and msg.get("op") == "step":
                    out["result"]["obs"]["text"] = "x" * (17 * 2**20)
                if mode == "stray-reply" and msg.get("op") == "reset":
                    stray = json.dumps({"id": 999_999, "ok": True, "result": None}).encode()
                    body = json.dumps(out).encode()
                    conn.sendall(struct.pack("!I", len(body)) + body + struct.pack("!I", len(stray)) + stray)
                    continue
                send(conn, out)
                if mode == "print-after-reset" and msg.get("op") == "reset":
                    sys.stdin.readline()
                    conn.sendall(b"reset done\n")
                if msg.get("op") == "close":
                    break
        except (EOFError, OSError):
            pass  # the pool hung up: this connection is done
        finally:
            conn.close()


if __name__ == "__main__":
    main()
