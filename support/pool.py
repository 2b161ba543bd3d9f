"""support/pool.py: independent jobs (the toy's methods x seeds) in a pool of processes, with a progress bar.

imap(fn, jobs, workers)   fn(job) for every job, `workers` processes at a time; a Ctrl-C stops them all at once
"""

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor, as_completed

from tqdm import tqdm

from support import stops


def imap(fn, jobs, workers, desc="runs"):
    """fn(job) for every job, `workers` processes at a time (spawned; 1: in this process), with a progress bar.
    Yields (job, result) as they finish."""
    if workers <= 1:
        for job in tqdm(jobs, desc=desc, leave=False):
            yield job, fn(job)
        return
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        # the workers start here (spawn: all at the first submit); a Ctrl-C is the parent's
        with stops.sigint_ignored():
            futures = {pool.submit(fn, job): job for job in jobs}
        try:
            for future in tqdm(as_completed(futures), total=len(jobs), desc=desc, leave=False):
                yield futures[future], future.result()
        except KeyboardInterrupt:  # a Ctrl-C: the running runs stop now, instead of the pool's exit waiting for them
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.kill()  # (the futures are not cancelled first: Python 3.11's pool would then print a traceback)
            raise
        except BaseException:
            for future in futures:
                future.cancel()
            raise
