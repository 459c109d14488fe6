"""Small helpers that several parts of the engine share."""
import math


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: the blocks that `a` tokens take at `b` tokens a block."""
    return -(-a // b)


def is_int(value, low: float = -math.inf, high: float = math.inf) -> bool:
    """Is `value` an integer (not a bool) in [low, high]?"""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
