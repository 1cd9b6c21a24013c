"""Issue 73: what handing one engine step's tokens to the HTTP event loop costs the engine thread. A thread posts one
event to each of N asyncio queues per step (N streams) while a running loop in another thread consumes them; between
steps it sleeps (the GPU part of a decode step, GIL free). Per token (`loop.call_soon_threadsafe(queue.put_nowait, ..)`,
the server before serve-speed) against evict.serve.server.Mailbox (one wake-up per batch). Prints the median ms per
step of the posting thread, each form run twice, alternating. CPU only:
python dev/serve_mailbox_bench.py [--streams 128] [--steps 300]"""

import argparse
import asyncio
import statistics
import threading
import time

from evict.serve.server import Mailbox


def run(batched: bool, n: int, steps: int) -> float:
    loop = asyncio.new_event_loop()
    queues: list[asyncio.Queue] = []
    ready = threading.Event()

    async def main():
        queues.extend(asyncio.Queue() for _ in range(n))
        ready.set()

        async def consume(q):
            for _ in range(steps):
                await q.get()

        await asyncio.gather(*(consume(q) for q in queues))

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()))
    thread.start()
    ready.wait()
    box = Mailbox(loop)
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        for q in queues:
            if batched:
                box.put(q, (s,))
            else:
                loop.call_soon_threadsafe(q.put_nowait, (s,))
        times.append(time.perf_counter() - t0)
        time.sleep(0.003)
    thread.join()
    loop.close()
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args()
    for batched in (False, True, False, True):
        name = "Mailbox (batched)" if batched else "call_soon_threadsafe per token"
        print(f"{name}: {run(batched, a.streams, a.steps):.3f} ms per step of {a.streams} tokens (posting thread)")


if __name__ == "__main__":
    main()
