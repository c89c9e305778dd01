from stats import median


def test_odd():
    assert median([1, 2, 3]) == 2


def test_single():
    assert median([5]) == 5


def test_unsorted_odd():
    assert median([9, 1, 5, 3, 7]) == 5


def test_even():
    assert median([1, 2, 3, 4]) == 2.5, median([1, 2, 3, 4])


def test_unsorted_even():
    assert median([10, 2, 8, 4]) == 6, median([10, 2, 8, 4])
