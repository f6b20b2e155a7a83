"""A sandbox worker that speaks the worker's protocol but answers each call as its code asks: well, or in one of
the ways a worker never would (what a program that could write into the worker's pipe might send). It answers
its start and the pool's first call as a worker does."""

from __future__ import annotations

import json
import struct
import sys

from rlvr_lightning.sandbox.worker import read_message, write_message

GOOD = {"stdout": "1\n", "stderr": "", "status": "ok", "exit_code": 0, "seconds": 0.001, "clean": True, "left": ""}
MALFORMED = {
    "no fields": {"status": "ok"},
    "a field of another type": {**GOOD, "exit_code": "0"},
    "a status no worker gives": {**GOOD, "status": "crashed"},
    "a boolean for a number": {**GOOD, "seconds": True},
    "more output than the cap": {**GOOD, "stdout": "x" * 100_000},
    "not an object": ["ok"],
}


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    write_message(stdout, {"ready": True, "privileges": {}})
    while (request := read_message(stdin)) is not None:
        code = request["code"]
        if code in MALFORMED:
            write_message(stdout, MALFORMED[code])
        elif code == "not JSON":
            stdout.write(struct.pack(">I", 9) + b"{not json")
            stdout.flush()
        elif code == "a length past any answer":
            stdout.write(struct.pack(">I", 2**31) + b"{}")
            stdout.flush()
        elif code == "a worker that reports what was left":
            write_message(stdout, {**GOOD, "clean": False, "left": "processes ['7']"})
        else:
            write_message(stdout, {**GOOD, "stdout": json.dumps(code) + "\n"} if code != "print(1)" else GOOD)


if __name__ == "__main__":
    main()
