"""bench draft's kernel clock: it counts the time spent inside the product and attention kernels
(ours and oneDNN's), and only while it runs."""

import time

from workers.tlt.bench.draft import kernel_clock
from workers.tlt.models import cpu_kernels, linear


def test_the_kernel_clock_counts_calls_into_our_kernels_and_puts_them_back(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "linear", lambda *args: time.sleep(0.02) or "y")
    monkeypatch.setattr(cpu_kernels, "attention", lambda *args: "out")
    monkeypatch.setattr(linear, "_onednn", lambda *args: time.sleep(0.02) or "z")
    fake = cpu_kernels.linear
    with kernel_clock() as spent:
        assert cpu_kernels.linear(1, 2) == "y" and cpu_kernels.attention() == "out"  # results pass through
        assert spent[0] >= 0.02
        assert linear._onednn(1, 2) == "z" and spent[0] >= 0.04  # oneDNN's products count too
        spent[0] = 0.0
        time.sleep(0.01)  # time outside the kernels is not counted
        assert spent[0] == 0.0
    assert cpu_kernels.linear is fake
