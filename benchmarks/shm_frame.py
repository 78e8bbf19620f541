"""One SHM frame's Python on one thread: the producer's header and commit, the consumer's read and check, the
step's inputs made from the frame (``input_of``), for a decode step of small-0.6b's layout (32 rows).

    python benchmarks/shm_frame.py [--frames 20000]

Prints the median of each piece in microseconds. In a loop of its own the code runs hot; on the hop it runs once
a step, after a spin, and costs several times more (the trace figures in BENCHMARKS.md), so these medians are
the floor of that Python, not its cost in place.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from omegaconf import OmegaConf

from corelib.config.schema import CorelibConfig
from corelib.startup.compose import compose_config
from corelib.step.layout import EngineLayout
from corelib.transport.doorbell import new_eventfd
from corelib.transport.shm import Consumer, Producer, Ring
from corelib.transport.wire import FrameHeader, FrameKind, input_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=20_000)
    args = parser.parse_args()
    config = OmegaConf.to_object(compose_config(["model=small-0.6b", "engine.max_num_seqs=32", "engine.transport=shm"]))
    assert isinstance(config, CorelibConfig)
    layout = EngineLayout.of(config).decode_layout
    ring = Ring.create("frame-bench", 4, 1 << 20, num_consumers=1)
    bell, room = new_eventfd(), new_eventfd()
    producer = Producer(ring, [bell], room, 30.0, name="bench ring")
    consumer = Consumer(ring, 0, bell, room, 30.0, name="bench ring")
    produce, read, parse = [], [], []
    try:
        for step in range(args.frames):
            producer.reserve()  # the packer's slot
            began = time.perf_counter()
            header = FrameHeader(FrameKind.step, 0, step_id=step, num_seqs=32, bucket=32, kv_blocks=1, sent_at=began,
                                 layout=layout.words, num_tokens=32, max_query_len=1, decode_rows=0)
            producer.commit(header, layout.nbytes)
            committed = time.perf_counter()
            frame = consumer.read()
            taken = time.perf_counter()
            input_of(frame.header, frame.payload, "frame")
            parsed = time.perf_counter()
            consumer.release(frame)
            produce.append(committed - began)
            read.append(taken - committed)
            parse.append(parsed - taken)
    finally:
        ring.close()
        for fd in (bell, room):
            os.close(fd)
    warm = args.frames // 10
    for name, times in (("produce (header, seal, commit)", produce), ("read (wait, check, views)", read),
                        ("inputs (input_of)", parse)):
        print(f"{name}: {statistics.median(times[warm:]) * 1e6:.2f} us")


if __name__ == "__main__":
    main()
