"""What checksums.json costs a checkpoint save, on the real SmolLM2-135M-Instruct with its AdamW state.

    python benchmarks/checkpoint_checksum.py                       # builds SmolLM2 first (python models.py smollm2)
    python benchmarks/checkpoint_checksum.py --model DIR --repeats 7 --out-dir /tmp/ckpt_bench

One process (a world of one over gloo), the model FSDP2-wrapped as train_grpo.py wraps it and one AdamW
step taken, so that the checkpoint holds weights and both moments: 1.6 GiB of shards. Each repeat saves
that state with checkpoint.Checkpointer.save twice, with checksums and without (integrity.write_checksums
replaced by a no-op), in alternating order, into a fresh directory deleted outside the timed region.
Printed: the median save time of each, the median of the per-repeat ratios, write_checksums' time inside
the saves and alone, and check_finite's (every save does it). For comparison: hashing every shard again
after the save (zlib.crc32, hashlib.blake2b; 1 MiB reads from the page cache), and integrity.problem_with
at resume, which checks every record of every shard against its CRC-32. Run it on an otherwise idle machine: a save is mostly writing
and fsync-ing the shards.
"""

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checkpoint  # noqa: E402
import integrity  # noqa: E402
import safe_write  # noqa: E402


def hash_files(paths, update, start):
    """Read each file 1 MiB at a time through update(chunk, state); the time it took."""
    t = time.perf_counter()
    for path in paths:
        state = start()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                state = update(chunk, state)
    return time.perf_counter() - t


def crc32_update(chunk, crc):
    return zlib.crc32(chunk, crc)


def blake2b_update(chunk, digest):
    digest.update(chunk)
    return digest


def no_checksums(ckpt, step):
    """write_checksums' stand-in for the saves without checksums."""


def timed(function, seconds):
    """`function`, appending the time each call takes to `seconds`."""

    def call(*args):
        t = time.perf_counter()
        function(*args)
        seconds.append(time.perf_counter() - t)

    return call


def row(label, seconds, save):
    """A line of the table: the median of `seconds`, and what share of a save (in s) it is."""
    median = statistics.median(seconds)
    return f"{label:<34} {median:7.3f} s   {median / save:6.1%} of a save"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="SmolLM2 in Hugging Face format (default: build it)")
    parser.add_argument("--repeats", type=int, default=5, help="saves of each kind")
    parser.add_argument("--out-dir", default=None, help="where the checkpoints go (default: a temp dir)")
    args = parser.parse_args()

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = args.out_dir or tempfile.mkdtemp(prefix="checkpoint_checksum_")
    if args.model is None:
        from models import build_smollm2

        args.model = build_smollm2(os.path.join(out, "smollm2"))
    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, trust_remote_code=False)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    model(ids, labels=ids).loss.backward()
    optimizer.step()  # the moments exist now: the checkpoint is the size a real one is
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    trainer_state = {"config": {"model": args.model}}
    with_checksums = integrity.write_checksums

    times, inside = {"with": [], "without": []}, []
    load = os.getloadavg()[0]
    for repeat in range(-1, args.repeats):  # repeat -1 warms up: the first save allocates what later ones reuse
        kinds = ["with", "without"] if repeat % 2 == 0 else ["without", "with"]
        for kind in kinds:
            run = os.path.join(out, f"run_{kind}")
            shutil.rmtree(run, ignore_errors=True)
            saver = checkpoint.Checkpointer(run)
            integrity.write_checksums = timed(with_checksums, inside) if kind == "with" else no_checksums
            t = time.perf_counter()
            saver.save(1, model, optimizer, trainer_state, tokenizer)
            if repeat >= 0:
                times[kind].append(time.perf_counter() - t)
                print(f"repeat {repeat + 1}: save {kind} checksums {times[kind][-1]:.2f} s", flush=True)
    integrity.write_checksums = with_checksums
    load = max(load, os.getloadavg()[0])

    saved = checkpoint.step_dir(os.path.join(out, "run_with"), 1)
    shards = [os.path.join(saved, "shards", n) for n in sorted(os.listdir(os.path.join(saved, "shards")))]
    size = sum(map(os.path.getsize, shards))
    alone, finite, crc, blake, verify = [], [], [], [], []
    state = {"model": checkpoint.trainable_state(model), "optim": get_optimizer_state_dict(model, optimizer)}
    tensors, _ = checkpoint.split_tensors(state)
    for _ in range(args.repeats):
        timed(with_checksums, alone)(saved, 1)
        timed(safe_write.check_finite, finite)(checkpoint.flat_items(tensors), "", "")
        crc.append(hash_files(shards, crc32_update, lambda: 0))
        blake.append(hash_files(shards, blake2b_update, lambda: hashlib.blake2b(digest_size=16)))
        t = time.perf_counter()
        assert integrity.problem_with(saved) is None
        verify.append(time.perf_counter() - t)

    save = statistics.median(times["without"])
    paired = statistics.median(w / o for w, o in zip(times["with"], times["without"]))
    print(f"\nSmolLM2-135M-Instruct + AdamW state: {size / 2**30:.2f} GiB of shards; medians of {args.repeats}")
    print(f"{'save without checksums':<34} {save:7.3f} s")
    print(
        f"{'save with checksums':<34} {statistics.median(times['with']):7.3f} s   ratio {paired:.3f} (median of the paired ratios)"
    )
    print(row("  write_checksums in those saves", inside[1:], save))  # inside[0]: the warm-up's
    print(row("  write_checksums alone", alone, save))
    print(row("  check_finite (both kinds do it)", finite, save))
    print("for comparison, hashing the shards again after the save:")
    print(row("  zlib.crc32, 1 MiB reads", crc, save))
    print(row("  hashlib.blake2b, 1 MiB reads", blake, save))
    print(row("at resume, problem_with", verify, save) + " (reads every record, checks its CRC-32, loads it)")
    if load > 1.5:  # one core of two busy elsewhere: the saves' times say more about the neighbours than about us
        print(f"note: the 1-minute load average reached {load:.1f} during the saves; their times are disturbed")
    dist.destroy_process_group()
    if args.out_dir is None:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
