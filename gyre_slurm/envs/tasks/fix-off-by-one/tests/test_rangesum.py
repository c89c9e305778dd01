from rangesum import sum_to


def test_small():
    assert sum_to(3) == 6, sum_to(3)


def test_one():
    assert sum_to(1) == 1, sum_to(1)


def test_zero():
    assert sum_to(0) == 0, sum_to(0)


def test_negative():
    assert sum_to(-4) == 0, sum_to(-4)


def test_hundred():
    assert sum_to(100) == 5050, sum_to(100)
