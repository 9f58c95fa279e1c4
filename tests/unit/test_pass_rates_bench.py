"""ops/bench/learning/pass_rates.py: the carry level it sorts toy questions by (the difficulty a graded pool would vary)."""

from tests.bench import load_bench

carry_level = load_bench("learning/pass_rates").carry_level


def test_carry_levels_count_the_worked_solutions_carries():
    assert carry_level("add2", "12+13=") == 0
    assert carry_level("add2", "19+23=") == 1  # units carry
    assert carry_level("add2", "59+63=") == 2  # units and tens
    assert carry_level("add3", "999+111=") == 3
    assert carry_level("mul21", "21*3=") == 0 and carry_level("mul21", "27*4=") == 2
    assert carry_level("sub2", "45-7=") == 0  # one digit: no worked steps
    assert carry_level("sub2", "45-13=") == 1 and carry_level("sub2", "45-17=") == 2  # borrow
    assert carry_level("addmul", "11+2*3=") == 0 and carry_level("addmul", "15+3*4=") == 1
    assert carry_level("addmul", "19+3*4=") == 2
