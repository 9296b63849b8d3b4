"""The card's SM clock and board power sampled by nvidia-smi while a benchmark runs, and which card it is.

This H200 runs power-limited, and the benchmark's figures move 2-4% between device calls on the same
build (docs/performance.md): recording the card's identity and the clock each timed block ran at
lets a reader tell a slower card or a hotter state from a slower kernel.
"""
import datetime
import signal
import statistics
import subprocess
import threading
import time

IDENTITY_FIELDS = ("name", "uuid", "serial", "pci.bus_id", "vbios_version", "power.limit", "enforced.power.limit",
                   "clocks.max.sm", "temperature.gpu")


def device_identity():
    """nvidia-smi's identity and power settings of GPU 0 as a dict; {"error": ...} without nvidia-smi."""
    try:
        line = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=" + ",".join(IDENTITY_FIELDS),
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": f"nvidia-smi: {e}"}
    return dict(zip(IDENTITY_FIELDS, (v.strip() for v in line.split(","))))


class SmiSampler:
    """nvidia-smi sampling GPU 0's SM clock, instantaneous board power and throttle reasons every
    `period_ms`, its lines collected by a thread; use as a context manager. Without nvidia-smi it
    collects nothing. (power.draw is a 1 s average: it lags a block timed for 60-220 ms after 1 s idle.)
    GPU 0 in nvidia-smi's order is CUDA's device 0 on a one-GPU machine, the bench's case."""

    def __init__(self, period_ms=50):
        self.period_ms = period_ms
        self.lines = []
        self.proc = None

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "-i", "0", "--query-gpu=timestamp,clocks.sm,power.draw.instant,clocks_event_reasons.active",
                 "--format=csv,noheader,nounits", "-lms", str(self.period_ms)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return self
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            time.sleep(0.3)  # the last window's samples
            self.proc.send_signal(signal.SIGINT)  # as Ctrl-C: it exits cleanly, its output flushed
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.reader.join(timeout=5)

    def samples_between(self, start, end, skip_s=0.0):
        """(clock MHz, power W, throttle reasons) samples inside [start + skip_s, end] (time.time())."""
        return samples_between(list(self.lines), start, end, skip_s)


def samples_between(lines, start, end, skip_s=0.0):
    """(clock MHz, power W, throttle reasons) of nvidia-smi's csv lines stamped inside [start + skip_s,
    end] (skip_s: a workload's ramp to leave out)."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            if start + skip_s <= t <= end:
                out.append((float(parts[1]), float(parts[2]), parts[3]))
        except ValueError:
            continue
    return out


def median_clock_power(samples):
    """(median clock MHz, median power W, the throttle reasons seen, sample count); None if no samples."""
    if not samples:
        return None
    return (statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples),
            sorted({s[2] for s in samples}), len(samples))
