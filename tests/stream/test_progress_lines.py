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
