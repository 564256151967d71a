"""One gang member with a cheap, deterministic compute, run as its own process so that tests can
SIGKILL it at any moment (usage: gang_driver.py STORE INPUT MEMBER HOSTS ATTEMPT RESUME PER_ROUND DELAY)."""
import sys
import time

from tokenfleet_serving.batch.checkpoint_store import CheckpointStore
from tokenfleet_serving.batch.job import Member, read_items, run_member


def compute(delay):
    def run(items):
        time.sleep(delay * len(items))
        return [{"square": item["x"] * item["x"]} for item in items]
    return run


if __name__ == "__main__":
    store, path, member, hosts, attempt, resume, per_round, delay = sys.argv[1:9]
    items, digest = read_items(path)
    run_member(CheckpointStore(store), items, digest, Member(int(member), int(hosts), int(attempt)), int(per_round),
               compute(float(delay)), resume=resume == "1", poll_s=0.005, wait_s=60)
