"""Which engine core gets a new request, worked by hand: the least loaded (ties to the lowest index); with prefix
caching, the core that was sent the prompt's first full blocks, unless its queue is longer than the least loaded
one's by more than the slack; a core's memory of blocks is as long as its pool."""

import pytest

from chapters import submodule

pytestmark = pytest.mark.requires("engine_core")

BLOCK = 4  # tokens per block in these tables


@pytest.fixture
def router_module(checkpoint):

    return submodule(checkpoint, "replica_router")


def make(router_module, cores=2, blocks=100, prefix_caching=True):
    return router_module.ReplicaRouter(cores, BLOCK, blocks, prefix_caching)


def prompt(first: int, length: int) -> list[int]:
    return list(range(first, first + length))


def test_least_loaded_with_ties_to_the_lowest_index(router_module):
    router = make(router_module, cores=3, prefix_caching=False)
    assert [router.route(prompt(100 * i, 8)) for i in range(5)] == [0, 1, 2, 0, 1]
    assert router.loads == [2, 2, 1]
    router.release(0)
    router.release(0)
    assert router.route(prompt(900, 8)) == 0  # loads [0, 2, 1]
    assert router.loads == [1, 2, 1]


def test_a_shared_prefix_goes_where_its_blocks_went(router_module):
    router = make(router_module)
    system = prompt(0, 8)  # two full blocks
    assert router.route(system + [50, 51, 52]) == 0
    assert router.route(prompt(500, 12)) == 1  # unrelated: the least loaded
    assert router.route(prompt(600, 12)) == 0  # loads [1, 1]: lowest index
    assert router.loads == [2, 1]
    assert router.route(system + [60, 61]) == 0  # core 0 holds the 2 blocks; 1 more request than core 1
    assert router.matched(0, router.block_hashes(system)) == 2 and router.matched(1, router.block_hashes(system)) == 0


def test_a_partial_block_is_no_match(router_module):
    router = make(router_module)
    assert router.route(prompt(0, 3)) == 0  # under one block: nothing remembered
    assert router.route(prompt(0, 3)) == 1  # least loaded
    assert router.seen == [{}, {}]


def test_the_slack_bounds_what_a_hit_is_worth(router_module):
    slack = router_module.PREFIX_LOAD_SLACK
    router = make(router_module)
    system = prompt(0, 8)
    assert router.route(system) == 0
    for _ in range(slack):
        assert router.route(system) == 0  # each time core 0 is at most `slack` requests ahead
    assert router.loads == [slack + 1, 0]
    assert router.route(system) == 1  # slack + 1 ahead: the hit is not worth the queue
    assert router.route(system) == 1  # now both hold it: the less loaded of the two


def test_the_longest_match_wins_and_memory_is_bounded(router_module):
    router = make(router_module, blocks=3)
    assert router.route(prompt(0, 8)) == 0  # core 0: blocks A, B
    assert router.route(prompt(0, 4) + prompt(40, 8)) == 0  # A matches on core 0 only (core 1 empty)
    assert router.route(prompt(0, 12)) == 0  # A, B on core 0; loads [3, 0] within the slack
    assert len(router.seen[0]) == 3  # A, B, C, C' ... held to the pool's 3 blocks, least recent out first
    first = router.block_hashes(prompt(0, 4))[0]
    assert first in router.seen[0]  # A was used last by the third request: kept


def test_one_core_or_no_prefix_caching_routes_by_load_alone(router_module):
    router = make(router_module, cores=1)
    assert [router.route(prompt(0, 8)) for _ in range(3)] == [0, 0, 0]
    assert router.seen == [{}]


def test_the_router_hashes_a_prompt_as_the_block_manager_does(checkpoint, router_module):
    """The router remembers blocks by the block manager's own chain: a prompt's hashes are the ones its
    sequence gets in a caching block manager (a partial last block has none)."""

    block_manager = submodule(checkpoint, "block_manager")
    sequence = submodule(checkpoint, "sequence")
    tokens = prompt(7, 3 * BLOCK + 2)
    seq = sequence.Sequence("0", tokens, checkpoint.SamplingParams(), set(), 64)
    manager = block_manager.BlockManager(16, BLOCK, enable_prefix_caching=True)
    assert make(router_module).block_hashes(tokens) == manager.block_hashes(seq, 3)
