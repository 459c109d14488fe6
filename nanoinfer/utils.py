"""Small helpers that several parts of the engine share."""


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: the blocks that `a` tokens take at `b` tokens a block."""
    return -(-a // b)
