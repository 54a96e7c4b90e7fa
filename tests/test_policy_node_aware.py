"""node_aware: DeepSeek's published README example (golden) and topology rules."""

import numpy as np
import pytest

from xllm_eplb.eplb.balance import rank_loads_from_phy2log
from xllm_eplb.eplb.policy import make_policy
from xllm_eplb.eplb.policy.node_aware import plan_node_aware
from xllm_eplb.errors import ConfigError

LOADS = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                  [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
PUBLISHED = np.array([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                      [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])
GPUS, SLOTS, NODES, GROUPS = 8, 2, 2, 4


def test_published_loads_reproduce():
    r = rank_loads_from_phy2log(PUBLISHED, LOADS, GPUS)
    assert r.max(axis=1).tolist() == [156.0, 179.5]


def test_deepseek_readme_example():
    out = plan_node_aware(LOADS, GPUS, SLOTS, NODES, GROUPS)
    assert out.shape == PUBLISHED.shape
    mine = rank_loads_from_phy2log(out, LOADS, GPUS).max(axis=1)
    ref = rank_loads_from_phy2log(PUBLISHED, LOADS, GPUS).max(axis=1)
    assert (mine <= ref + 1e-9).all()
    for layer in out:
        assert set(layer.tolist()) == set(range(12))                  # every expert present
        ranks = layer.reshape(GPUS, SLOTS)
        assert all(len(set(row)) == SLOTS for row in ranks)            # one replica per GPU
        node_of_slot = np.arange(layer.size) // (layer.size // NODES)
        for g in range(GROUPS):                                        # a group sits on one node
            nodes = {int(node_of_slot[s]) for s in range(layer.size) if layer[s] // 3 == g}
            assert len(nodes) == 1
        for n in range(NODES):                                         # 2 groups per node
            groups = {int(e) // 3 for e in layer[node_of_slot == n]}
            assert len(groups) == GROUPS // NODES


def test_topology_rules_are_config_errors():
    with pytest.raises(ConfigError, match="must divide ep_size"):
        make_policy("node_aware", 4, 16, 1, num_nodes=3)
    with pytest.raises(ConfigError, match="num_groups"):
        make_policy("node_aware", 4, 16, 1, num_nodes=2, num_groups=3)


def test_default_groups_avoid_the_contiguous_group_trap():
    # load trends with expert id: contiguous groups put all hot experts on node 0
    load = np.linspace(100, 1, 32)[None].round().astype(np.int64)
    free = make_policy("node_aware", 8, 32, 1, num_nodes=2)
    trap = make_policy("node_aware", 8, 32, 1, num_nodes=2, num_groups=2)
    prev = np.full((1, 8 * 5), -1)
    pk = [rank_loads_from_phy2log(np.stack(p.plan(load, prev)), load, 8).max()
          for p in (free, trap)]
    assert pk[0] < pk[1]
