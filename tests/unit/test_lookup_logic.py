from kvray.lookup import leading_hits


def test_leading_hits_needs_every_rank():
    # rank-major: rank 0 has blocks 0-2, rank 1 has blocks 0-1 and 3
    present = [True, True, True, False, True, True, False, True]
    assert leading_hits(present, 4, 2) == 2
    assert leading_hits([True] * 4, 4, 1) == 4
    assert leading_hits([False, True], 2, 1) == 0
    assert leading_hits([], 0, 3) == 0
