"""The flips bench's comparison: where two answers drawn with the same keys first part."""

from workers.tlt.bench.flips import first_difference


def test_the_first_difference_is_the_first_unequal_token_or_where_the_shorter_answer_ends():
    assert first_difference([5, 6, 7], [5, 6, 7]) is None
    assert first_difference([5, 6, 7], [5, 9, 7]) == 1
    assert first_difference([5, 6, 7], [5, 6]) == 2  # one answer stopped (EOS) where the other went on
    assert first_difference([], []) is None
