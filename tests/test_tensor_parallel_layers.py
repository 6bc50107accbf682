"""The tensor-parallel layers in real gloo process groups of 2 and 4 ranks, with gloo's
all-reduce and with the shared-memory one (which also sums in rounds, the same bits on
every rank): every rank's
q/k/v heads, the row-parallel all-reduce, a column- then row-parallel MLP, the
vocabulary-parallel embedding and LM head equal the unsharded layers (float32); with fewer
key/value heads than ranks, each is replicated (vLLM's rule); sizes that do not divide
are refused with a message naming them."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp
from tp_workers import check_rank, check_shm_all_reduce

from sluice.engine.distributed.parallel_state import TPGroup
from sluice.engine.distributed.shm_all_reduce import create_segment
from sluice.engine.layers.parallel_linear import qkv_shards

pytestmark = pytest.mark.slow  # processes


@pytest.mark.parametrize("all_reduce", ["gloo", "shared memory"])
@pytest.mark.parametrize("world, kv_heads", [(2, 2), (4, 2)], ids=["split", "replicated"])
def test_parallel_layers_equal_the_unsharded_ones(tmp_path, world, kv_heads, all_reduce):
    shm = None
    if all_reduce == "shared memory":
        shm = str(tmp_path / "segment")
        create_segment(shm, world)
    mp.spawn(check_rank, args=(world, str(tmp_path / "rendezvous"), kv_heads, shm),
             nprocs=world)


@pytest.mark.parametrize("world", [2, 3])
def test_the_shared_memory_all_reduce_is_the_rank_ordered_sum_everywhere(tmp_path, world):
    shm = str(tmp_path / "segment")
    create_segment(shm, world)
    mp.spawn(check_shm_all_reduce, args=(world, str(tmp_path / "rendezvous"), shm),
             nprocs=world)


def test_heads_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match=r"number of attention heads \(9\) is not divisible "
                                         r"by the tensor-parallel size \(2\)"):
        qkv_shards(9, 3, 64, TPGroup(0, 2, group=object()))
    with pytest.raises(ValueError, match=r"tensor-parallel size \(12\) exceeds the number of key/value heads \(8\)"):
        qkv_shards(12, 8, 64, TPGroup(0, 12, group=object()))
