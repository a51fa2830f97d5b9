"""``pd._nixl.register`` without NIXL: an agent's refusal to register memory becomes an error that
names the argument, with the page-sharing hint for host memory (a heap array that shares a page
with another registration cannot be registered: seen on the GPU machine in test_pd)."""

from __future__ import annotations

import pytest

from hisparse_cupy.pd import _nixl


class _Agent:
    def __init__(self, fail: bool):
        self.fail, self.calls = fail, []

    def register_memory(self, descs, mem):
        self.calls.append((descs, mem))
        if self.fail:
            raise RuntimeError("NIXL_ERR_BACKEND")
        return "registration"


def test_register_returns_the_agents_registration():
    a = _Agent(fail=False)
    assert _nixl.register(a, "pool", 0x10000, 4096, 0, "DRAM") == "registration"
    assert a.calls == [([(0x10000, 4096, 0, "")], "DRAM")]


@pytest.mark.parametrize("mem", ["DRAM", "VRAM"])
def test_a_refused_registration_names_the_argument(mem):
    with pytest.raises(RuntimeError, match=r"^kv: NIXL could not register its 4096 bytes of "
                       + mem + r" at 0x10000 \(.*NIXL_ERR_BACKEND") as e:
        _nixl.register(_Agent(fail=True), "kv", 0x10000, 4096, 1, mem)
    assert ("pages of its own" in str(e.value)) == (mem == "DRAM")
