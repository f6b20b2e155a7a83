"""Tests of one in-process check with math-verify (`rewards.verification.verify_answer`)."""

from __future__ import annotations

import threading

from rlvr_lightning.rewards.verification import verify_answer


def test_verify_answer_in_process():
    assert verify_answer("\\frac{1}{2}", "0.5")
    assert verify_answer("\\frac{1}{2}", "\\dfrac12")
    assert verify_answer("1234", "1,234")
    assert verify_answer("025", "25")  # AIME golds have leading zeros
    assert verify_answer("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\pi/2)")
    assert not verify_answer("\\frac{1}{2}", "0.6")
    assert not verify_answer("5", None)
    assert not verify_answer("5", "")
    assert not verify_answer("", "5")
    for junk in ("}{", "\\frac{", "$$", "\\boxed{", "\x00", "__import__('os')", "a" * 5000):
        assert verify_answer("5", junk) is False  # never raises


def test_verify_answer_off_main_thread():
    # SIGALRM timeouts cannot be used off the main thread; it must still verify.
    out = []
    t = threading.Thread(target=lambda: out.append(verify_answer("\\frac{1}{2}", "0.5")))
    t.start()
    t.join()
    assert out == [True]
