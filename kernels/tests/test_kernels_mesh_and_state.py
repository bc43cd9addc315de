"""Mesh sizes are checked before any group exists; the sharded-state protocol describes pieces exactly."""

import pytest
import torch

from plait.kernels.mesh import (
    check_parallel_world,
    complement_dims,
    flat_group,
    make_mesh,
    parallel_mesh,
    resolve_mesh_sizes,
)
from plait.kernels.sharded_state import ShardedStateful, ShardedTensor, ShardSpec, even_flat_range, flat_overlap
from plait.kernels.testing import run_distributed


def test_mesh_sizes_resolve_and_refuse_with_names():
    assert resolve_mesh_sizes(8, dp=-1, sp=2) == {"dp": 4, "sp": 2}
    assert resolve_mesh_sizes(4, dp=2, sp=2) == {"dp": 2, "sp": 2}
    with pytest.raises(ValueError, match=r"multiply to 6 but the world size is 4"):
        resolve_mesh_sizes(4, dp=3, sp=2)
    with pytest.raises(ValueError, match=r"not divisible by 3.*dp=-1"):
        resolve_mesh_sizes(4, dp=-1, sp=3)
    with pytest.raises(ValueError, match=r"'ep': 0"):
        resolve_mesh_sizes(4, dp=4, ep=0)
    with pytest.raises(ValueError, match="only one mesh dimension may be -1"):
        resolve_mesh_sizes(4, dp=-1, sp=-1)
    with pytest.raises(ValueError, match="at least one named dimension"):
        resolve_mesh_sizes(4)


def _build_mesh() -> tuple:
    mesh = make_mesh(dp=-1, sp=2)
    both, none = parallel_mesh(2, 2), parallel_mesh(1, 1)
    return (mesh.mesh_dim_names, tuple(mesh.shape), mesh["sp"].size(), both.mesh_dim_names, tuple(both.shape),
            none)


def test_make_mesh_builds_named_dimensions():
    for names, shape, sp, both_names, both_shape, none in run_distributed(_build_mesh, 4, timeout=60):
        assert names == ("dp", "sp") and shape == (2, 2) and sp == 2
        assert both_names == ("dp", "ep", "sp") and both_shape == (1, 2, 2) and none is None  # sp innermost


def test_parallel_sizes_must_divide_the_world():
    check_parallel_world(2, 2, 8)
    with pytest.raises(ValueError, match=r"^X\.sp_size=3 does not divide the world size 4 \(ranks\); use one of "
                                         r"\[1, 2, 4\]"):
        check_parallel_world(3, 1, 4, field_prefix="X.", world="ranks")
    with pytest.raises(ValueError, match=r"^sp_size=2 x ep_size=2 = 4 does not divide the world size 6;"):
        check_parallel_world(2, 2, 6)


def test_make_mesh_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        make_mesh(dp=1)


def test_flat_and_sliced_specs_index_the_global_tensor():
    full = torch.arange(24.0).view(4, 6)
    flat = ShardSpec(name="w", kind="parameter", global_shape=(4, 6), dtype=torch.float32, flat_range=(5, 11),
                     replica_ranks=(3, 1))
    assert flat.local_shape == (6,) and flat.writer_rank == 1
    assert flat.index_into(full).tolist() == list(range(5, 11))
    sliced = ShardSpec(name="w", kind="parameter", global_shape=(4, 6), dtype=torch.float32,
                       slices=((1, 3), (2, 6)))
    assert sliced.local_shape == (2, 4)
    assert torch.equal(sliced.index_into(full), full[1:3, 2:6])
    assert ShardSpec.full("b", torch.zeros(3, 2)).flat_range == (0, 6)


@pytest.mark.parametrize("kwargs, message", [
    ({"flat_range": (0, 25)}, "outside"),
    ({"flat_range": (0, 2), "slices": ((0, 1), (0, 1))}, "exactly one"),
    ({"slices": ((0, 1),)}, "one \\(start, stop\\) per dim"),
    ({"slices": ((0, 5), (0, 6))}, r"slices\[0\]"),
    ({"flat_range": (0, 2), "kind": "weights"}, "kind='weights'"),
    ({"flat_range": (0, 2), "replica_ranks": ()}, "replica_ranks"),
])
def test_bad_specs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShardSpec(name="w", kind=kwargs.pop("kind", "parameter"), global_shape=(4, 6), dtype=torch.float32, **kwargs)


def test_sharded_tensor_checks_shape_and_dtype():
    spec = ShardSpec(name="w", kind="parameter", global_shape=(10,), dtype=torch.float32, flat_range=(0, 3))
    ShardedTensor(spec, torch.zeros(3))
    with pytest.raises(ValueError, match="local shape"):
        ShardedTensor(spec, torch.zeros(4))
    with pytest.raises(ValueError, match="dtype"):
        ShardedTensor(spec, torch.zeros(3, dtype=torch.float16))


def test_even_ranges_cover_every_element_once():
    for numel in (1, 7, 10, 12):
        for world in (1, 2, 3, 4):
            ranges = [even_flat_range(numel, r, world) for r in range(world)]
            covered = [i for start, stop in ranges for i in range(start, stop)]
            assert covered == list(range(numel)), (numel, world)
    assert flat_overlap((0, 5), (3, 9)) == (3, 5) and flat_overlap((0, 3), (3, 9)) is None


class _Holder:
    def __init__(self) -> None:
        self.w = torch.arange(6.0)

    def sharded_state_dict(self):
        return {"w": ShardedTensor(ShardSpec.full("w", self.w), self.w)}

    def load_sharded_state_dict(self, state):
        self.loaded = True


def test_protocol_is_structural_and_pieces_alias_live_storage():
    holder = _Holder()
    assert isinstance(holder, ShardedStateful)
    holder.sharded_state_dict()["w"].local.fill_(7.0)
    assert torch.equal(holder.w, torch.full((6,), 7.0))


def _flat_groups() -> dict[str, list[int]]:
    import torch.distributed as dist

    mesh = make_mesh(dp=2, ep=2)
    with pytest.raises(ValueError, match=r"\['tp'\] are not among them"):
        flat_group(mesh, ("dp", "tp"))
    assert complement_dims(mesh, ("dp",)) == ("ep",)
    return {"dp": dist.get_process_group_ranks(flat_group(mesh, ("dp",))),
            "ep": dist.get_process_group_ranks(flat_group(mesh, ("ep",))),
            "both": dist.get_process_group_ranks(flat_group(mesh, ("ep", "dp")))}


def test_flat_group_of_mesh_dimensions():
    for rank, groups in enumerate(run_distributed(_flat_groups, 4, timeout=60)):
        dp, ep = divmod(rank, 2)
        assert groups == {"dp": [ep, 2 + ep], "ep": [2 * dp, 2 * dp + 1], "both": [0, 1, 2, 3]}


def _sub_mesh_flat_groups() -> dict[str, tuple[list[int], float]]:
    """A 3-D ``dp x sp x ep`` mesh (sp=1 so it fits 4 ranks) and sub-meshes covering half the world:
    each rank's ``mesh.mesh`` holds only its own slice, yet the groups must be the same everywhere."""
    import torch.distributed as dist

    mesh = make_mesh(dp=2, sp=1, ep=2)
    rank = dist.get_rank()
    cases = {
        "sub_dp_sp": flat_group(mesh["dp", "sp"], ("dp", "sp")),
        "full_dp_sp": flat_group(mesh, ("dp", "sp")),
        "sub_sp_ep": flat_group(mesh["sp", "ep"], ("sp", "ep")),
        "sub_dp_ep_dp": flat_group(mesh["dp", "ep"], ("dp",)),
        "full_ep_sp": flat_group(mesh, ("ep", "sp")),
        "full_all": flat_group(mesh, ("dp", "sp", "ep")),
        "sub_dp_ep": flat_group(mesh["dp", "ep"], ("dp", "ep")),
    }
    out = {}
    for name, group in cases.items():
        value = torch.tensor([float(1 << rank)])
        dist.all_reduce(value, group=group)  # a bit per rank: the sum names exactly who took part
        out[name] = (dist.get_process_group_ranks(group), value.item())
    return out


def test_flat_group_of_a_sub_mesh_covering_part_of_the_world():
    for rank, groups in enumerate(run_distributed(_sub_mesh_flat_groups, 4, timeout=60)):
        dp, ep = divmod(rank, 2)
        same_ep, same_dp = [ep, 2 + ep], [2 * dp, 2 * dp + 1]
        expected = {"sub_dp_sp": same_ep, "full_dp_sp": same_ep, "sub_sp_ep": same_dp, "sub_dp_ep_dp": same_ep,
                    "full_ep_sp": same_dp, "full_all": [0, 1, 2, 3], "sub_dp_ep": [0, 1, 2, 3]}
        assert {name: ranks for name, (ranks, _) in groups.items()} == expected, rank
        assert {name: total for name, (_, total) in groups.items()} == {
            name: float(sum(1 << r for r in ranks)) for name, ranks in expected.items()}, rank
