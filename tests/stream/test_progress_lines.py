"""The streamed writer's progress lines: a small, fast checkpoint prints its header line only; a slow one a
line per tenth of the bytes, at most one a second, with a time left that follows the average rate."""

from normfold.stream import writer


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _run(monkeypatch, seconds_per_tenth):
    clock = Clock()
    monkeypatch.setattr(writer.time, "perf_counter", clock)
    lines = []
    p = writer._Progress(1000, lines.append)
    p.file("out.safetensors", 10)
    for _ in range(10):
        clock.t += seconds_per_tenth
        p.add(100)
    return lines


def test_a_fast_small_checkpoint_prints_its_header_only(monkeypatch):
    lines = _run(monkeypatch, 0.01)
    assert lines == ["writing out.safetensors (10 tensors): 0.00 of 0.00 GB"]


def test_a_slow_checkpoint_prints_a_line_per_tenth_with_a_steady_time_left(monkeypatch):
    lines = _run(monkeypatch, 2.0)
    assert len(lines) == 1 + 9  # the header, then 10 % ... 90 % (100 % is the caller's own line)
    left = [float(line.rsplit("~", 1)[1].split(" s left")[0]) for line in lines[1:]]
    assert left == sorted(left, reverse=True)  # constant rate: the estimate only goes down
    assert left[0] == 18 and left[-1] == 2


# One time-left estimate for the whole command (stream.progress.Work): conversion and verification weighted by
# their measured cost per element.

from normfold.stream import progress  # noqa: E402


def _job(monkeypatch, convert_s, verify_s, step=0.25):
    """A fake command: the conversion advances steadily for `convert_s` seconds, then the verification's
    five passes for `verify_s` seconds in all (each pass in proportion to its weight), a step every `step`
    s; the writer's and the verifier's lines as the CLI prints them. Returns [(time, seconds left)]."""
    clock = Clock()
    monkeypatch.setattr(writer.time, "perf_counter", clock)
    lines = []
    work = progress.Work({"convert": progress.CONVERT_WEIGHT, "verify": sum(progress.VERIFY_PASS_WEIGHTS)})
    say = progress.Reporter(lambda m: lines.append((clock.t, m)), work)
    p = writer._Progress(1000, say, work)
    p.file("out.safetensors", 10)
    n = round(convert_s / step)
    for i in range(n):
        clock.t += step
        p.add(1000 // n + (1 if i < 1000 % n else 0))
    track = progress.PassProgress(work, say)
    w = progress.VERIFY_PASS_WEIGHTS
    for k, wk in enumerate(w):
        say(f"pass {k}{work.suffix()}")
        track.start(f"pass {k}", 100)
        units = max(1, round(verify_s * wk / sum(w) / step))
        for j in range(units):
            clock.t += step
            track.done(100 // units + (1 if j < 100 % units else 0))
    assert work.done() == 1.0
    return [(t, float(m.rsplit("~", 1)[1].split(" s left")[0])) for t, m in lines if " s left" in m]


def test_the_time_left_counts_the_verification_and_only_goes_down_on_a_steady_job(monkeypatch):
    convert_s = 10.0
    verify_s = convert_s * sum(progress.VERIFY_PASS_WEIGHTS)  # each phase as fast as its weight says
    left = _job(monkeypatch, convert_s, verify_s)
    end = 100.0 + convert_s + verify_s
    assert len(left) > 10
    for (t, s), (_, s2) in zip(left, left[1:]):
        assert s2 <= s + 1  # never up (but for the rounding to whole seconds)
    for t, s in left:
        assert abs(s - (end - t)) <= 0.1 * (end - 100.0) + 1  # and about right, from the conversion's lines on
    first_t, first = left[0]
    assert first > end - 100.0 - convert_s  # the first line, while writing, counts the verification to come


def test_a_phase_slower_or_faster_than_its_weight_moves_the_estimate_gradually(monkeypatch):
    for factor in (0.5, 2.0, 3.0):
        convert_s = 10.0
        left = _job(monkeypatch, convert_s, factor * convert_s * sum(progress.VERIFY_PASS_WEIGHTS))
        for (t, s), (t2, s2) in zip(left, left[1:]):
            # between two lines the estimate rises by at most 15 % (+1 s of rounding), never jumps
            assert s2 <= 1.15 * s + 1, (factor, t, s, t2, s2)


def test_pass_progress_counts_each_pass_by_its_weight(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(writer.time, "perf_counter", clock)
    work = progress.Work({"verify": 1.0})
    track = progress.PassProgress(work)
    w = progress.VERIFY_PASS_WEIGHTS
    for k in range(len(w)):
        track.start(f"pass {k}", 40)
        track.done(10)
        assert abs(work.done() - (sum(w[:k]) + w[k] / 4) / sum(w)) < 1e-12
        track.done(30)
        assert abs(work.done() - sum(w[:k + 1]) / sum(w)) < 1e-12
