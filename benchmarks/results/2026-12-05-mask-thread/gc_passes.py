"""json_paced.py with every pass of the collector over generations 1 and 2 printed as it ends (its ms)."""
import gc
import sys
import time

sys.path.insert(0, ".")
import json_paced

started: dict[str, float] = {}


def timed(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        started["at"] = time.perf_counter()
    elif info["generation"] >= 1:
        print(f"collector pass, generation {info['generation']}: {(time.perf_counter() - started['at']) * 1e3:.1f} ms, "
              f"{info['collected']} collected", flush=True)


gc.callbacks.append(timed)
json_paced.main()
