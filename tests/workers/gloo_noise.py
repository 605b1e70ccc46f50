"""Worker: gloo's chatter written to fd 1 as gloo's C++ does, from threads, while Python prints lines.

Each operand of gloo's one ``std::cout << ...`` statement is one write (atomic on a pipe), and three threads
interleave their operands in random order.

python gloo_noise.py LINES SEED
"""

import os
import random
import sys
import threading
import time

import jddp

jddp.initialize()  # under `jddp launch`: sys.stdout moves to its own pipe

lines, seed = int(sys.argv[1]), int(sys.argv[2])
OPERANDS = [
    b"[Gloo] Rank ",
    b"0",
    b" is connected to ",
    b"11",
    b" peer ranks. ",
    b"Expected number of connected peer ranks is : ",
    b"11",
    b"\n",
]


def chatter(rng: random.Random) -> None:
    for _ in range(lines):
        for operand in OPERANDS:
            os.write(1, operand)
            if rng.random() < 0.3:
                time.sleep(0)  # let another thread's operands in between


threads = [threading.Thread(target=chatter, args=(random.Random(seed + i),)) for i in range(3)]
for t in threads:
    t.start()
for i in range(lines):
    print(f"line {i} of the script", flush=True)
    sys.stderr.write(f"\rprogress {i}")
    sys.stderr.flush()
sys.stderr.write("\n")
for t in threads:
    t.join()
