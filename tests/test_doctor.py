"""``fastfeed doctor``: the probe, the stage clock, the verdict and the rebuild, in process;
then the command on small scripts (tests/doctor_scripts/): the costly transform named first, a
compute-bound loop sold nothing, batches unchanged under the doctor, and bad input as one line.

Verdicts are made robust by extreme scripts (a transform that sleeps 40 ms, a step that sleeps
200 ms), never by timing thresholds in the tests; the stage figures are compared with the same
stages timed directly, beside a CPU-bound process.
"""

from __future__ import annotations

import json
import runpy
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_same, run_epochs
from procs import alive
from sample_datasets import MixedDataset, TensorDataset
from torch.utils.data import DataLoader

from fastfeed import FastLoader
from fastfeed.__main__ import main
from fastfeed.doctor.findings import Diagnosis, Stage
from fastfeed.doctor.fingerprint import fingerprint, resolve
from fastfeed.doctor.gpu_waits import GpuWaits
from fastfeed.doctor.loaders import LoaderSpec
from fastfeed.doctor.measure import stages_ruled_out
from fastfeed.doctor.probe import Probe, Window, WindowClosed
from fastfeed.doctor.report import format_report
from fastfeed.doctor.stages import StageClock, StageCost, profile_samples
from fastfeed.doctor.trials import made_rate
from fastfeed.doctor.verdict import BALANCED, COMPUTE_BOUND, DATA_BOUND, judge

SCRIPTS = Path(__file__).parent / "doctor_scripts"
# Short windows and one loader-alone run per configuration: these tests check what the doctor
# says, not how precisely it measures.
QUICK = ["--repeats", "1", "--trial-batches", "4", "--trial-seconds", "1"]


def doctor(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fastfeed", "doctor", *args],
                          capture_output=True, text=True, timeout=timeout)


def doctor_here(capfd, *args: str) -> tuple[int, str, str]:
    """The command in this process (its measuring process writes to the same descriptors):
    a second start of Python and torch less than :func:`doctor`."""
    code = main(["doctor", *args])
    out, err = capfd.readouterr()
    return code, out, err


# -- in process -------------------------------------------------------------------------------


def test_verdict_rules():
    assert judge(0.6, 100, 110).name == DATA_BOUND
    assert judge(0.15, 100, None).name == DATA_BOUND
    assert judge(0.01, 100, 1000).name == COMPUTE_BOUND
    assert judge(0.01, 100, None).name == COMPUTE_BOUND  # before the ceiling is measured
    assert judge(0.01, 100, 120).name == BALANCED  # barely waits, but no room to spare
    assert judge(0.10, 100, 1000).name == BALANCED
    assert not judge(0.01, 100, 1000).loader_helps
    assert "10.0×" in " ".join(judge(0.01, 100, 1000).evidence)
    # A wait that, given back whole, would shorten steps by less than the gain the doctor counts
    # (1.10×) cannot be the loader's to fix: 8 % gives at most 1.09×, 10 % 1.11×.
    assert judge(0.08, 100, 1000).name == COMPUTE_BOUND
    assert "at most 1.09×" in " ".join(judge(0.08, 100, 1000).evidence)
    assert judge(0.08, 100, None).name == COMPUTE_BOUND
    assert judge(0.08, 100, 120).name == BALANCED
    # Which balance: the loader just keeping up, or a wait for what training shares with it.
    assert "just keeps up" in " ".join(judge(0.10, 100, 120).evidence)
    assert "shares" in " ".join(judge(0.10, 100, 1000).evidence)
    assert "shares" in " ".join(judge(0.50, 100, 1000).evidence)
    assert "shares" not in " ".join(judge(0.50, 100, 110).evidence)


class Subclassed(DataLoader):
    """A loader whose ``__iter__`` draws from ``super().__iter__()``, as frameworks' do."""

    def __iter__(self):
        yield from super().__iter__()


def _loaders():
    return [DataLoader(TensorDataset(24), batch_size=4, shuffle=True),
            Subclassed(TensorDataset(24), batch_size=4, shuffle=True, num_workers=2),
            FastLoader(MixedDataset(24), batch_size=4, shuffle=True, num_workers=2)]


def test_probe_times_every_batch_and_changes_none():
    originals = (DataLoader.__init__, DataLoader.__iter__, FastLoader.__iter__,
                 Subclassed.__iter__)
    expected = [run_epochs(loader, 2, seed=5) for loader in _loaders()]
    probe = Probe(Window(warmup=0, batches=1000, seconds=1e9))
    probe.install()
    try:
        loaders = _loaders()
        seen = [run_epochs(loader, 2, seed=5) for loader in loaders]
    finally:
        probe.uninstall()
    for mine, theirs in zip(seen, expected, strict=True):
        assert_same(mine, theirs)
    # One trace per loader (the subclass's inner super().__iter__ is not timed twice), every
    # batch of both epochs delivered and counted with its samples.
    assert [t.batches for t in probe.traces] == [12, 12, 12]
    assert all(sum(t.samples) == 48 for t in probe.traces)
    assert all(w >= 0 for t in probe.traces for w in t.waits)
    assert [t.name.rsplit(".", 1)[-1] for t in probe.traces] == [
        "DataLoader", "Subclassed", "FastLoader"]
    assert (DataLoader.__init__, DataLoader.__iter__, FastLoader.__iter__,
            Subclassed.__iter__) == originals
    assert loaders[2].stats().batches == 12  # FastLoader still found its own iterator


def test_window_closes_with_the_step_after_it():
    opened, closed = [], []
    probe = Probe(Window(warmup=2, batches=3, seconds=1e9),
                  on_start=lambda t, _: opened.append(t.batches),
                  on_close=lambda t, loader: closed.append((t.batches, loader.batch_size)))
    probe.install()
    try:
        got = []
        with pytest.raises(WindowClosed):
            # A loader nothing else holds: torch's iterator does not keep it, the probe must.
            for batch in DataLoader(TensorDataset(40), batch_size=2):
                got.append(batch)
        with pytest.raises(WindowClosed):  # and every later request, from any loader
            next(iter(DataLoader(TensorDataset(4))))
    finally:
        probe.uninstall()
    # Two warm-up batches, then three steps: the third step ends at the sixth request.
    assert len(got) == 5 and opened == [2] and closed == [(5, 2)]
    assert probe.closed_by is probe.traces[0] and len(probe.traces[0].computes) == 5


def test_let_finish_passes_batches_through_after_the_window():
    probe = Probe(Window(warmup=0, batches=2, seconds=1e9, stop=False))
    probe.install()
    try:
        batches = list(DataLoader(TensorDataset(20), batch_size=2))
    finally:
        probe.uninstall()
    assert len(batches) == 10 and probe.closed and probe.traces[0].batches == 3


def test_steps_with_another_loaders_batches_are_marked():
    probe = Probe(Window(warmup=0, batches=100, seconds=1e9))
    probe.install()
    try:
        train, val = DataLoader(TensorDataset(8)), DataLoader(TensorDataset(2))
        for step, _ in enumerate(train):
            if step == 2:
                list(val)  # a validation pass inside the third step
    finally:
        probe.uninstall()
    assert probe.traces[0].clean == [True, True, False, True, True, True, True, True]


class FakeEvent:
    """A CUDA event on a simulated GPU clock: completes when ``gpu.now`` passes its time."""

    def __init__(self, gpu):
        self.gpu, self.at = gpu, None

    def record(self, stream=None):
        self.at = max(self.gpu.busy_until, self.gpu.now)  # after the work queued before it

    def query(self):
        return self.gpu.now >= self.at

    def synchronize(self):
        self.gpu.now = max(self.gpu.now, self.at)

    def elapsed_time(self, end):
        assert self.query() and end.query(), "read before it completed"
        return 1000 * (end.at - self.at)


class FakeGpu:
    now = 0.0
    busy_until = 0.0


def test_gpu_waits_count_only_the_time_the_gpu_had_nothing_queued():
    gpu = FakeGpu()
    waits = GpuWaits(active=lambda: True, event=lambda: FakeEvent(gpu), stream=lambda: None)
    gpu.busy_until = 0.5  # work queued until 0.5 s; the host asks for a batch at 0.1 s
    gpu.now = 0.1
    mark = waits.request()
    gpu.now = 0.3  # the batch arrives at 0.3 s, while the GPU is still busy: no idle time
    waits.deliver(0, mark)
    assert waits.idle_s == {}  # not read before the events complete
    gpu.now, gpu.busy_until = 0.6, 0.6
    mark = waits.request()
    gpu.now = 0.9  # the GPU was idle from 0.6 s until this batch arrived
    waits.deliver(1, mark)
    waits.finish()
    assert waits.idle_s == pytest.approx({0: 0.0, 1: 0.3})
    assert GpuWaits(active=lambda: False).request() is None  # no CUDA context made here


def test_stage_clock_charges_each_stage_its_own_time():
    now = [0.0]
    clock = StageClock(lambda: now[0])

    def inner():
        now[0] += 2

    def outer():
        now[0] += 1
        clock.run("inner", "transform", inner)
        now[0] += 3

    clock.run("outer", "transform", outer)
    assert clock.seconds == {"inner": 2, "outer": 4}


def test_stage_clock_leaves_out_the_wait_for_a_cpu():
    now, waited = [0.0], [0.0]
    clock = StageClock(lambda: now[0], lambda: waited[0])

    def inner():
        now[0] += 3
        waited[0] += 2  # runnable, but every core was taken, for 2 of its 3 seconds

    def outer():
        now[0] += 1
        clock.run("inner", "transform", inner)
        now[0] += 5
        waited[0] += 4

    clock.run("outer", "transform", outer)
    assert clock.seconds == {"inner": 1, "outer": 2}


class Sleepy:
    def __call__(self, x):
        import time

        time.sleep(0.005)
        return x


class Pipeline:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class Folder(torch.utils.data.Dataset):
    def __init__(self, files):
        self.samples = [(str(f), 0) for f in files]
        self.loader = lambda path: torch.tensor(list(Path(path).read_bytes()), dtype=torch.float)
        self.transform = Pipeline([torch.neg, Pipeline([Sleepy(), torch.abs])])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, target = self.samples[i]
        return self.transform(self.loader(path)), target


def test_profile_names_each_stage_and_puts_everything_back(tmp_path):
    files = []
    for i in range(6):
        files.append(tmp_path / f"{i}.bin")
        files[-1].write_bytes(bytes(range(i, i + 16)))
    dataset = Folder(files)
    before = (list(dataset.transform.transforms), list(dataset.transform.transforms[1].transforms),
              dataset.loader)
    costs, batch = profile_samples(dataset, torch.utils.data.default_collate, 3)
    names = [c.stage for c in costs]
    assert names[0] == "Sleepy"
    loader_line = dataset.loader.__code__.co_firstlineno
    assert set(names) == {"Sleepy", "torch.neg", "torch.abs", "Pipeline", "file read",
                          f"open + decode (<lambda> at test_doctor.py:{loader_line})",
                          "__getitem__ (rest)", "collate"}
    assert [c.ms for c in costs] == sorted((c.ms for c in costs), reverse=True)
    assert batch[0].shape == (3, 16)
    assert (list(dataset.transform.transforms), list(dataset.transform.transforms[1].transforms),
            dataset.loader) == before
    assert "loader" in vars(dataset) and dataset[0][0].shape == (16,)


class Listed(torch.utils.data.Dataset):
    """A dataset whose ``transforms`` is a plain list (or tuple) of transforms, applied in
    its own ``__getitem__``."""

    def __init__(self, transforms):
        self.transforms = transforms

    def __len__(self):
        return 6

    def __getitem__(self, i):
        x = torch.full((4,), float(i))
        for t in self.transforms:
            x = t(x)
        return x


@pytest.mark.parametrize("kind", [list, tuple])
def test_a_plain_list_of_transforms_is_timed_by_name(kind):
    dataset = Listed(kind([torch.neg, Sleepy(), Pipeline([torch.abs])]))
    before = dataset.transforms
    costs, _ = profile_samples(dataset, torch.utils.data.default_collate, 3)
    names = [c.stage for c in costs]
    assert names[0] == "Sleepy"
    assert {"torch.neg", "Pipeline", "torch.abs",
            "__getitem__ (rest)", "collate"} <= set(names)
    assert dataset.transforms is before and type(before) is kind  # given back as it was
    assert list(before)[:2] == [torch.neg, before[1]] and isinstance(before[1], Sleepy)


def known_costs() -> dict:
    """The names of tests/doctor_scripts/known_costs.py (its ``main`` not run)."""
    return runpy.run_path(str(SCRIPTS / "known_costs.py"))


def _expected_names(script: dict) -> list[str]:
    lambda_line = script["STAGES"][1].__code__.co_firstlineno
    return ["random_crop", f"<lambda> at known_costs.py:{lambda_line}", "hflip", "Normalize"]


def test_transforms_of_every_kind_are_named():
    # A function, a lambda, a functools.partial and a callable object, in a plain list.
    script = known_costs()
    dataset = script["Signals"](list(script["STAGES"]))
    costs, _ = profile_samples(dataset, script["collate"], script["BATCH"], most=8)
    assert set(_expected_names(script)) <= {c.stage for c in costs}
    assert dataset.transforms == script["STAGES"]  # the timers are off again


class KeepsAllButOne(torch.utils.data.Dataset):
    """Keeps the items it loaded, all but one (the oldest goes first), as Ultralytics keeps
    the images it loaded for Mosaic: counts its reads and its loads."""

    def __init__(self, length: int) -> None:
        self.length, self.kept, self.reads, self.loads = length, [], 0, 0

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        self.reads += 1
        if index not in self.kept:
            self.loads += 1
            self.kept.append(index)
            if len(self.kept) >= self.length:
                self.kept.pop(0)
        return torch.tensor(index)


def test_a_short_dataset_is_timed_over_epochs_as_training_reads_it():
    """Stages timed on a dataset's first pass alone, or on passes in one order (which a cache
    of all but one item misses every time), cost more than the loader's workers pay: its
    measured rate then ruled every stage out (an Ultralytics run of 24 images). The profile
    meets the dataset's cache about as often as a shuffling DataLoader does."""
    profiled = KeepsAllButOne(8)
    profile_samples(profiled, None, None, budget_s=60, most=64)
    loaded = KeepsAllButOne(8)
    torch.manual_seed(0)
    loader = DataLoader(loaded, batch_size=None, shuffle=True)
    assert sum(1 for _ in range(8) for _ in loader) == 64
    missed = {"profile": profiled.loads / profiled.reads, "loader": loaded.loads / loaded.reads}
    assert missed["profile"] <= 2 * missed["loader"], missed


def test_stage_figures_the_loader_rate_rules_out_are_not_printed():
    stages = [StageCost("decode", 4.0, "decode"), StageCost("collate", 6.0, "collate")]
    # 10 ms a sample: two workers deliver at most 200 samples/s, the main process alone 100.
    assert stages_ruled_out(stages, 2, 200) == stages_ruled_out(stages, 0, 110) == ""
    assert stages_ruled_out(stages, "auto", 10_000) == ""  # no fixed count to bound with
    assert stages_ruled_out(stages, 2, None) == ""
    why = stages_ruled_out(stages, 2, 1000)
    assert "10.00 ms a sample" in why and "at most 200 samples/s" in why and "1,000" in why
    found = Diagnosis(outcome="report", verdict="data-bound", stall_fraction=0.5,
                      per_batch_ms=[Stage("main process (next() with a batch ready)", 1.0)],
                      stages_ruled_out=why)
    report = format_report(found)
    assert f"Not shown: {why}" in report and "decode" not in report


def test_a_window_of_prefetched_batches_rules_out_no_stage_figures():
    """A rate measured over a window no longer than the batches the workers had prefetched
    when it opened (all ready, where the main process lost its core for a moment on a busy
    machine) bounds nothing: only the batches made inside the window count."""
    stages = [StageCost("decode", 4.0, "decode")]  # two workers make at most 500 samples/s
    assert made_rate(3200, 4, 4) == 0.0 and made_rate(3200, 0, 4) == 0.0
    assert stages_ruled_out(stages, 2, made_rate(3200, 4, 4)) == ""
    assert made_rate(3200, 8, 4) == 1600.0  # at least half the window was made inside it
    assert stages_ruled_out(stages, 2, made_rate(3200, 8, 4))  # still too fast for them
    assert stages_ruled_out(stages, 2, made_rate(3200, 40, 4))


def _direct_ms(function, *args, repeats: int = 9) -> float:
    """The median CPU time of a few runs on this thread: what the stage costs a core that
    runs it, however long this thread waited for one beside the busy core (its wall time
    here grew several times over that, on a machine whose every core was busy)."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        function(*args)
        times.append(1000 * (time.thread_time() - start))
    return statistics.median(times)


@pytest.fixture
def busy_core():
    """A CPU-bound process beside the test, for its whole length."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    spinner.kill()
    spinner.wait()


def test_stage_figures_hold_beside_a_cpu_bound_process(busy_core, capfd, tmp_path):
    script = known_costs()
    code, out, err = doctor_here(capfd, "--warmup", "2", "--batches", "4", *QUICK, "--json",
                                 str(tmp_path / "d.json"), str(SCRIPTS / "known_costs.py"))
    assert code == 0, err
    found = json.loads((tmp_path / "d.json").read_text())
    assert not found["stages_ruled_out"], found["stages_ruled_out"]
    per_sample = {s["stage"]: s["ms"] for s in found["per_sample_ms"]}
    per_batch = {s["stage"]: s["ms"] for s in found["per_batch_ms"]}
    # The same stages timed here, as a worker runs them: one intra-op thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sample = torch.zeros(script["SAMPLE"])
        direct = {name: _direct_ms(stage, sample)
                  for name, stage in zip(_expected_names(script), script["STAGES"], strict=True)}
        direct_collate = _direct_ms(script["collate"], [sample] * script["BATCH"])
    finally:
        torch.set_num_threads(threads)
    figures = {**{name: per_sample.get(name) for name in direct},
               "collate": per_batch.get("collate")}
    direct["collate"] = direct_collate
    for name, ms in figures.items():
        assert ms is not None and 0.5 <= ms / direct[name] <= 2, (name, figures, direct)
    assert all(name in out for name in direct)  # the report names them too


def test_loader_spec_rebuilds_the_same_batches():
    generator = torch.Generator().manual_seed(7)
    loader = DataLoader(MixedDataset(20), batch_size=3, shuffle=True, num_workers=2,
                        generator=generator, drop_last=True)
    spec = LoaderSpec.of(loader)
    assert spec.batch_size == 3 and spec.length == 6 and spec.workers == 2
    spec.reset_random()
    first = list(spec.build())
    spec.reset_random()  # the generator is put back: the same shuffle and worker seeds again
    assert_same(list(spec.build(fast=True)), first)
    spec.reset_random()
    assert_same(list(spec.build()), first)


def test_fingerprints_tell_batches_apart():
    batch = {"x": torch.arange(10_000.0).reshape(100, 100), "y": ["a", "b"]}
    same = {"x": torch.arange(10_000.0).reshape(100, 100), "y": ["a", "b"]}
    flipped = {"x": batch["x"].flip(0), "y": ["a", "b"]}
    renamed = {"x": batch["x"], "y": ["a", "c"]}
    a, b, c, d = resolve([fingerprint(v) for v in (batch, same, flipped, renamed)])
    assert a == b and a != c and a != d


# -- the command ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def costly(tmp_path_factory):
    out = tmp_path_factory.mktemp("costly")
    run = doctor("--warmup", "2", "--batches", "8", *QUICK, "--json", str(out / "d.json"),
                 "--out", str(out), str(SCRIPTS / "costly_transform.py"))
    return run, out


def test_costly_transform_is_named_first_and_the_run_data_bound(costly):
    run, out = costly
    assert run.returncode == 0, run.stderr
    found = json.loads((out / "d.json").read_text())
    assert found["verdict"] == "data-bound"
    assert found["per_sample_ms"][0]["stage"] == "SlowBlur"
    assert {"ToFloat", "Flip", "collate"} <= {s["stage"] for s in found["per_sample_ms"]}
    assert found["loader"]["class"] == "torch.utils.data.dataloader.DataLoader"
    assert found["loader"]["batch_size"] == 8 and found["loader"]["num_workers"] == 2
    assert 0 <= found["stall_fraction"] <= 1
    assert found["consumer_samples_per_s"] > 0 and found["loader_ceiling_samples_per_s"] > 0
    measured = {o["key"]: o for o in found["measured"]}
    assert {"yours", "swap"} <= set(measured)
    assert measured["swap"]["same_batches"] is True  # the contract, checked by fingerprints
    if "workers" in measured:  # the count "auto" settled on, on the script's own loader
        assert measured["workers"]["change"] != "DataLoader(..., num_workers=2)"
    for option in found["recommendations"]:
        assert set(option) >= {"change", "speedup", "same_batches"}
        assert option["speedup"] >= 1.1 and option["change"]
    # The device options are measured where there is a GPU, named unmeasured where there is none.
    no_gpu = any("no GPU" in u["reason"] for u in found["unmeasured"])
    assert no_gpu != torch.cuda.is_available()
    assert "DATA-BOUND" in run.stdout and "SlowBlur" in run.stdout
    assert len(found["timeline_ms"]["wait"]) == 8


def test_pictures_are_written(costly):
    pytest.importorskip("matplotlib")
    _, out = costly
    for name in ("timeline.png", "stages.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_compute_bound_loop_is_sold_nothing(capfd, tmp_path):
    code, out, err = doctor_here(capfd, "--warmup", "3", "--batches", "5", *QUICK, "--json",
                                 str(tmp_path / "d.json"), str(SCRIPTS / "compute_bound.py"))
    assert code == 0, err
    found = json.loads((tmp_path / "d.json").read_text())
    assert found["verdict"] == "compute-bound", found["evidence"]
    assert found["recommendations"] == [] and found["unmeasured"] == []
    assert [o["key"] for o in found["measured"]] == ["yours"]  # the ceiling, nothing else
    assert "COMPUTE-BOUND" in out and "Nothing to change" in out
    assert "×  from fastfeed" not in out


@pytest.fixture(scope="module")
def plain_batches(tmp_path_factory):
    """What the script sees without the doctor."""
    plain = tmp_path_factory.mktemp("plain") / "plain.txt"
    subprocess.run([sys.executable, str(SCRIPTS / "record_batches.py"), "--out", str(plain)],
                   check=True, timeout=60)
    return plain.read_text().splitlines()


@pytest.mark.parametrize("let_finish", [True, False], ids=["let-finish", "stopped"])
def test_batches_are_unchanged_and_no_worker_outlives_the_doctor(capfd, tmp_path,
                                                                 plain_batches, let_finish):
    watched = tmp_path / "watched.txt"
    code, out, err = doctor_here(capfd, "--warmup", "1", "--batches", "3", *QUICK,
                                 *(["--let-finish"] if let_finish else []),
                                 str(SCRIPTS / "record_batches.py"), "--out", str(watched))
    assert code == 0, err
    expected, seen = plain_batches, watched.read_text().splitlines()
    assert len(expected) == 24
    # Stopped, the script saw the warm-up batch and three steps; the request for the fifth
    # batch was refused.
    assert seen == (expected if let_finish else expected[:4])
    pids = [int(p) for p in Path(f"{watched}.pids").read_text().split()]
    assert pids and not any(alive(pid) for pid in pids)
    assert "processes running" not in out  # the script stopped its own workers


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--mode", "fail"], 1,
     "it failed before the window closed: ValueError: the data directory is empty (its "
     "traceback is above)"),
    (["--mode", "exit"], 1, "it failed before the window closed: exit status 3"),
    (["--mode", "no-loader"], 2, "it never iterated a DataLoader"),
    (["--fail-after", "2"], 1, "RuntimeError: diverged after 2 batches"),
], ids=["fails", "exits", "no-loader", "fails-in-window"])
def test_bad_input_is_one_line_after_the_scripts_own_error(capfd, tmp_path, args, code,
                                                          message):
    script = str(SCRIPTS / "record_batches.py")
    returned, out, err = doctor_here(capfd, script, "--out", str(tmp_path / "o"), *args)
    assert returned == code
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"fastfeed doctor: {script}: ") and message in last, err
    assert out.count("fastfeed doctor:") == 0  # no report
    if "traceback" in message:
        # The script's own traceback, as Python prints it, from the script's frame down.
        traceback = err.split("Traceback (most recent call last):\n", 1)[1]
        assert traceback.startswith(f'  File "{script}", line')
        assert "ValueError: the data directory is empty\n" in traceback
        assert "runpy" not in traceback and "fastfeed" not in traceback.split("\n")[0]


def test_a_run_shorter_than_the_window_is_reported_on_the_steps_it_had(capfd, tmp_path):
    # One epoch of 12 batches, against a window of 5 warm-up batches and 50 steps: the seven
    # batches after the warm-up are seven steps (the last one's ends as the script asks for
    # a thirteenth, which ends the epoch).
    code, out, err = doctor_here(capfd, *QUICK, "--json", str(tmp_path / "d.json"),
                                 str(SCRIPTS / "record_batches.py"), "--out",
                                 str(tmp_path / "o"), "--epochs", "1")
    assert code == 0, err
    found = json.loads((tmp_path / "d.json").read_text())
    assert found["window"]["steps"] == 7 and found["window"]["batches"] == 12
    assert found["window"]["script_ended"] and not found["window"]["stopped"]
    assert len(found["timeline_ms"]["wait"]) == 7
    assert ("watched 7 training steps after 5 warm-up batches" in out
            and "until the script ended, after 12 batches" in out), out
    assert found["system"]["cores_used"] > 0  # its workers had ended: their time is counted


def test_a_run_within_the_warm_up_has_no_report(capfd, tmp_path):
    script = str(SCRIPTS / "record_batches.py")
    code, out, err = doctor_here(capfd, "--warmup", "20", script, "--out",
                                 str(tmp_path / "o"), "--epochs", "1")
    assert code == 2 and "fastfeed doctor:" not in out
    assert err.strip().splitlines()[-1] == (
        f"fastfeed doctor: {script}: it ended after 12 batches, within the 20 warm-up "
        "batches: no training step was measured (try --warmup 10)")


def test_a_missing_script_is_one_line(capfd):
    code, _, err = doctor_here(capfd, "no/such/train.py")
    assert code == 2
    assert err.strip() == "fastfeed doctor: error: no/such/train.py: no such file"


def test_overhead_benchmark_runs(tmp_path):
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "doctor_overhead.py"),
                          "--pairs", "2", "--chunk", "2", "--apart", "1000",
                          "--json", str(tmp_path / "o.json")],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    figures = json.loads((tmp_path / "o.json").read_text())
    assert set(figures["loaders"]) == {"DataLoader", "FastLoader"}
    assert all(r["plain"] > 0 and r["probed"] > 0 for r in figures["loaders"].values())
    assert figures["probe_us_per_batch"] > 0 and "| FastLoader |" in out


def test_sigterm_stops_the_script_and_its_workers(tmp_path):
    """The measuring process has a session of its own: a terminated doctor must not leave it
    running the script (SIGTERM reaches it as an interrupt)."""
    import signal
    import time

    out = tmp_path / "seen.txt"
    doctor_process = subprocess.Popen(
        [sys.executable, "-m", "fastfeed", "doctor", "--batches", "1000", "--seconds", "600",
         str(SCRIPTS / "record_batches.py"), "--out", str(out), "--epochs", "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not Path(f"{out}.pids").exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # until the script's workers have started
    doctor_process.send_signal(signal.SIGTERM)
    _, err = doctor_process.communicate(timeout=60)
    assert doctor_process.returncode == 1
    assert "it failed before the window closed: KeyboardInterrupt" in err
    pids = [int(p) for p in Path(f"{out}.pids").read_text().split()]
    assert pids and not any(alive(pid) for pid in pids)
