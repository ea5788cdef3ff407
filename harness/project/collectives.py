"""The time of one collective under the alpha-beta model, per algorithm: on one link, and on a cluster whose
nodes have a faster link inside than between them (harness.project.cluster).

    python -c "from harness.project.cluster import preset; from harness.project.collectives import \\
        collective_time; print(collective_time('all_reduce', 1e9, 16, preset('dgx-h100-ib'), 'hierarchical'))"

The model (Hockney's, in the notation of Thakur, Rabenseifner and Gropp 2005, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 19(1):49-66): a step in which a rank sends k bytes to a
peer takes alpha + k beta; alpha is the latency per step (s), beta the time per byte (s/byte, 1 / the
link's one-direction bandwidth). A rank sends and receives at once (full duplex); the messages of one step
travel in parallel on separate links; the time to reduce (their gamma) is left out, since a GPU adds
numbers far faster than a link delivers them.

Sizes n are nccl-tests' sizes, as everywhere in parbench (harness.derive.comm): the all-reduced tensor,
the whole gathered output of an all-gather, the whole scattered input of a reduce-scatter, the send buffer
of an all-to-all, the tensor of a broadcast or reduce. Sizes in bytes, times in seconds. One rank moves
nothing: every time at p = 1 is 0.

**One link** (every pair of ranks joined alike; what a `harness comm` run on one host measures):
time = steps(p) alpha + bytes_factor(p) n beta. `ONE_LINK_FORMS` holds the two terms of each algorithm;
harness.project.fit uses the same terms to turn measured times into alpha and beta.

**A cluster** of m nodes of g GPUs (p = m g; ranks fill whole nodes): alpha_i and B_i are one GPU's link
inside its node, alpha_e and B_e one node's link to the others (all its NICs together). Where all g GPUs
of a node cross the node boundary at once, they share B_e (each gets B_e / g); a ring or chain that visits
a node's GPUs in turn crosses its boundary once per channel, and NCCL gives each channel its own NIC, so
the node's crossing traffic (the same bytes each GPU sends inside the node) goes at B_e. Each formula below
says which case it is. docs/projection.md states the model's limits.

**Which algorithm** (ClusterModel): a call gets the algorithm of least modelled time among those its
library runs for the collective (LIBRARY_ALGORITHMS: NCCL's ring or tree for all-reduce, MPI's ring or
halving-doubling, ...), as NCCL's tuner and MPICH's size thresholds choose; a forced algorithm overrides it.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

from harness.derive.comm import BUSBW_FACTORS, Collective
from harness.project.cluster import Cluster, Link, NodeLayout
from harness.spec import SpecError

THAKUR_2005 = "Thakur, Rabenseifner and Gropp 2005, IJHPCA 19(1)"
NCCL_TUNING = ("NVIDIA/nccl src/graph/tuning.cc ncclTopoTuneModel: steps nsteps/nInterSteps at "
               "01afd20a77b5804e0ecf1042509dd9d20ebf9e93, tree ratio .5 and log2i(nNodes) at "
               "b6475625fbcaa2c3c0e50eed2fa1255d7514d4a2")
# A parameter server: workers push gradients to server nodes and pull the parameters back (Li et al. 2014); the
# Horovod paper (sec. 2, "Going distributed", Fig. 3) names its cost: one server is likely a networking or
# computational bottleneck, and several make the traffic all-to-all, which may saturate the interconnect.
PARAMETER_SERVER = ("Li et al. 2014, \"Scaling Distributed Machine Learning with the Parameter Server\", OSDI; "
                    "Sergeev and Del Balso 2018, \"Horovod: fast and easy distributed deep learning in TensorFlow\", "
                    "arXiv:1802.05799, sec. 2")


class Algorithm(enum.StrEnum):
    RING = "ring"                   # all-reduce, all-gather, reduce-scatter: NCCL's ring
    TREE = "tree"                   # all-reduce: NCCL's double binary tree (chain inside a node)
    HIERARCHICAL = "hierarchical"   # all-reduce: reduce-scatter in the node, all-reduce across, all-gather
    HALVING_DOUBLING = "halving_doubling"   # reduce-scatter by recursive halving, all-gather by recursive
                                            # doubling, all-reduce both (Rabenseifner): power-of-two ranks
    CHAIN = "chain"                 # broadcast, reduce: a pipelined chain (NCCL's "ring" for these)
    PAIRWISE = "pairwise"           # all-to-all: p - 1 rounds of pairwise exchange
    STAR = "star"                   # send, recv: a dedicated parameter server's link, every message on it in turn


DEFAULT_ALGORITHMS: dict[str, Algorithm] = {
    Collective.ALL_REDUCE: Algorithm.RING,
    Collective.ALL_GATHER: Algorithm.RING,
    Collective.REDUCE_SCATTER: Algorithm.RING,
    Collective.BROADCAST: Algorithm.CHAIN,
    Collective.REDUCE: Algorithm.CHAIN,
    Collective.ALL_TO_ALL: Algorithm.PAIRWISE,
    # A pipeline's point to point: a send is one hop, alpha + n beta on the link between the two ranks (a chain
    # of 2); its recv is the same bytes arriving, carried by the peer's send, so it is priced at nothing.
    Collective.SEND: Algorithm.CHAIN,
    Collective.RECV: Algorithm.CHAIN,
}
POINT_TO_POINT = ("send", "recv")


class Library(enum.StrEnum):
    """The collective library that runs on the target: it decides which algorithms a call can get."""

    NCCL = "nccl"       # GPUs: what DDP, FSDP2, DeepSpeed and Horovod (built with NCCL) reduce with
    GLOO = "gloo"       # CPUs under PyTorch's or Horovod's gloo
    MPI = "mpi"         # MPICH-style MPI (Horovod on MPI)


# The algorithms each library can run per collective; a call gets the one of least modelled time, as NCCL's
# tuner picks by its own model (enqueue.cc: the algorithm and protocol of least predicted time) and MPICH
# picks by message size from the same alpha-beta costs (Thakur et al. 2005, sec. 4). Ties go to the first.
LIBRARY_ALGORITHMS: dict[Library, dict[str, tuple[Algorithm, ...]]] = {
    # NCCL: the tree is for all-reduce only (tuning.cc at 01afd20: "if (coll != ncclFuncAllReduce && a !=
    # NCCL_ALGO_RING) continue;"). CollNet, NVLS and PAT, which later versions add, are not modelled
    # (docs/projection.md, Limits), nor is Horovod's hierarchical all-reduce, which is opt-in
    # (HOROVOD_HIERARCHICAL_ALLREDUCE): `--algorithm all_reduce=hierarchical` forces it.
    Library.NCCL: {Collective.ALL_REDUCE: (Algorithm.RING, Algorithm.TREE),
                   Collective.ALL_GATHER: (Algorithm.RING,), Collective.REDUCE_SCATTER: (Algorithm.RING,),
                   Collective.BROADCAST: (Algorithm.CHAIN,), Collective.REDUCE: (Algorithm.CHAIN,),
                   Collective.ALL_TO_ALL: (Algorithm.PAIRWISE,), **{c: (Algorithm.CHAIN,) for c in POINT_TO_POINT}},
    # gloo: gloo::allreduce is a ring (gloo/allreduce.cc; PyTorch's ProcessGroupGloo sets
    # Algorithm::RING, Horovod's GlooAllreduce takes the default), gloo::allgather a ring. A reduce-scatter
    # is priced as the ring's; PyTorch's gloo runs it as an all-reduce of the whole buffer and a slice
    # (ProcessGroupGloo::reduce_scatter_tensor_coalesced), about twice that, and Horovod's as
    # gloo::ReduceScatterHalvingDoubling (horovod/common/ops/gloo_operations.cc; `--algorithm
    # reduce_scatter=halving_doubling`). No strategy here issues Horovod's.
    Library.GLOO: {Collective.ALL_REDUCE: (Algorithm.RING,), Collective.ALL_GATHER: (Algorithm.RING,),
                   Collective.REDUCE_SCATTER: (Algorithm.RING,),
                   Collective.BROADCAST: (Algorithm.CHAIN,), Collective.REDUCE: (Algorithm.CHAIN,),
                   Collective.ALL_TO_ALL: (Algorithm.PAIRWISE,), **{c: (Algorithm.CHAIN,) for c in POINT_TO_POINT}},
    # MPI as MPICH (Thakur et al. 2005): all-reduce by Rabenseifner's halving-doubling for long messages
    # (its reduce-scatter exchanges the larger halves with the nearer ranks, its all-gather in reverse); where
    # p is not a power of two MPICH folds the extra ranks in first, which is not modelled: the ring then.
    # Long all-gathers by the ring and long reduce-scatters by pairwise exchange (the ring's alpha-beta
    # cost); their short-message recursive doubling and halving, which send the larger halves to the
    # farther ranks, are not modelled.
    Library.MPI: {Collective.ALL_REDUCE: (Algorithm.RING, Algorithm.HALVING_DOUBLING),
                  Collective.ALL_GATHER: (Algorithm.RING,), Collective.REDUCE_SCATTER: (Algorithm.RING,),
                  Collective.BROADCAST: (Algorithm.CHAIN,), Collective.REDUCE: (Algorithm.CHAIN,),
                  Collective.ALL_TO_ALL: (Algorithm.PAIRWISE,), **{c: (Algorithm.CHAIN,) for c in POINT_TO_POINT}},
}


def _floor_log2(p: int) -> int:
    """Depth of a binary tree of p vertices (NCCL's log2i)."""
    return int(p).bit_length() - 1


def _is_power_of_two(p: int) -> bool:
    return p >= 1 and p & (p - 1) == 0


def applies(algorithm: Algorithm, ranks: int) -> bool:
    """Whether the model holds `algorithm` at `ranks`: halving-doubling only at a power of two (elsewhere
    MPICH and gloo add steps to fold the extra ranks in, which are not modelled)."""
    return algorithm is not Algorithm.HALVING_DOUBLING or _is_power_of_two(ranks)


def check_applies(algorithm: Algorithm, ranks: int) -> None:
    if not applies(algorithm, ranks):
        raise SpecError(f"algorithm {algorithm.value!r} is modelled for a power-of-two number of ranks, got {ranks}; "
                        "allowed: 1, 2, 4, 8, ...")


@dataclass(frozen=True, slots=True)
class Form:
    """time = steps(p) alpha + bytes_factor(p) n beta on one link, with the source of both terms."""

    steps: Callable[[int], float]
    bytes_factor: Callable[[int], float]
    source: str


ONE_LINK_FORMS: dict[tuple[str, Algorithm], Form] = {
    # Ring all-reduce = ring reduce-scatter + ring all-gather: 2(p-1) steps of n/p bytes each, so
    # 2(p-1) alpha + 2(p-1)/p n beta. Thakur et al. build their long-message all-reduce from these two
    # halves (Rabenseifner's algorithm) and give the ring for all-gather; NCCL counts nsteps = 2(nRanks-1)
    # and converts bus to algorithm bandwidth with nRanks/nsteps. The bytes factor is nccl-tests' bus
    # factor 2(p-1)/p, which PERFORMANCE.md derives from exactly this ring.
    (Collective.ALL_REDUCE, Algorithm.RING): Form(
        lambda p: 2 * (p - 1), BUSBW_FACTORS[Collective.ALL_REDUCE], f"{THAKUR_2005}; {NCCL_TUNING}"),
    # Ring all-gather (Thakur et al.'s ring algorithm): p-1 steps, each passing on one rank's n/p bytes:
    # (p-1) alpha + (p-1)/p n beta, n the whole gathered output. Reduce-scatter is the same ring run the
    # other way (n the whole scattered input).
    (Collective.ALL_GATHER, Algorithm.RING): Form(
        lambda p: p - 1, BUSBW_FACTORS[Collective.ALL_GATHER], f"{THAKUR_2005}; {NCCL_TUNING}"),
    (Collective.REDUCE_SCATTER, Algorithm.RING): Form(
        lambda p: p - 1, BUSBW_FACTORS[Collective.REDUCE_SCATTER], f"{THAKUR_2005}; {NCCL_TUNING}"),
    # Double binary tree (Sanders, Speck and Traeff 2009, "Two-tree algorithms for full bandwidth
    # broadcast, reduction and scan", Parallel Computing 35(12); NCCL >= 2.4): each half of the data goes
    # up one tree and back down; a rank that is inner in one tree is a leaf in the other, so it sends 2n
    # and receives 2n in all. Latency: up and down a tree of depth floor(log2 p). NCCL: latency
    # 2 log2i(nNodes) interLat with one rank per node, algorithm bandwidth = bus bandwidth x .5.
    # At p = 2 the tree is a chain that moves n each way, so 2n overstates it there.
    (Collective.ALL_REDUCE, Algorithm.TREE): Form(
        lambda p: 2 * _floor_log2(p), lambda p: 2.0, f"Sanders, Speck and Traeff 2009; {NCCL_TUNING}"),
    # Recursive halving reduce-scatter (Thakur et al., sec. 4.2): lg p steps, the k-th exchanging n/2^k
    # bytes with one partner: lg p alpha + (p-1)/p n beta. Recursive doubling all-gather is the same steps
    # in reverse (sec. 4.1). Rabenseifner's all-reduce is the one then the other (sec. 4.4):
    # 2 lg p alpha + 2(p-1)/p n beta. p a power of two.
    (Collective.ALL_REDUCE, Algorithm.HALVING_DOUBLING): Form(
        lambda p: 2 * _floor_log2(p), BUSBW_FACTORS[Collective.ALL_REDUCE], f"Rabenseifner's algorithm; {THAKUR_2005}"),
    (Collective.ALL_GATHER, Algorithm.HALVING_DOUBLING): Form(
        _floor_log2, BUSBW_FACTORS[Collective.ALL_GATHER], f"recursive doubling; {THAKUR_2005}"),
    (Collective.REDUCE_SCATTER, Algorithm.HALVING_DOUBLING): Form(
        _floor_log2, BUSBW_FACTORS[Collective.REDUCE_SCATTER], f"recursive halving; {THAKUR_2005}"),
    # Pipelined chain (NCCL's ring broadcast/reduce: nccl-tests' bus factor 1, NCCL ratio nRanks/nsteps = 1
    # with nsteps = nRanks): with many small chunks the last rank has the data after p-1 hops' latency
    # plus n beta. NCCL charges nsteps = p latencies; p-1 is the hop count of a chain of p ranks.
    (Collective.BROADCAST, Algorithm.CHAIN): Form(lambda p: p - 1, BUSBW_FACTORS[Collective.BROADCAST],
                                                  f"{NCCL_TUNING}; nccl-tests BroadcastGetBw"),
    (Collective.REDUCE, Algorithm.CHAIN): Form(lambda p: p - 1, BUSBW_FACTORS[Collective.REDUCE],
                                               f"{NCCL_TUNING}; nccl-tests ReduceGetBw"),
    # Pairwise exchange (the algorithm Thakur et al. use for long all-to-all messages): p-1 rounds, in
    # each a rank exchanges the n/p bytes meant for one peer with that peer: (p-1) alpha + (p-1)/p n beta.
    (Collective.ALL_TO_ALL, Algorithm.PAIRWISE): Form(
        lambda p: p - 1, BUSBW_FACTORS[Collective.ALL_TO_ALL], THAKUR_2005),
    # One message between two ranks (Hockney's alpha + n beta); the receiving side's time is the send's.
    (Collective.SEND, Algorithm.CHAIN): Form(lambda p: p - 1, BUSBW_FACTORS[Collective.SEND], "Hockney 1994"),
    (Collective.RECV, Algorithm.CHAIN): Form(lambda p: 0, lambda p: 0.0, "the peer's send carries it"),
    # A dedicated parameter server's link: every message it sends or receives is one more alpha + n beta on it, in
    # turn. Its recv is priced too: a server receives every gradient shard, steps its optimizer and only then sends,
    # so the two directions of its full-duplex link do not overlap and no send carries a recv. Never a library's
    # choice (LIBRARY_ALGORITHMS): the strategy's layout decides it (Strategy.point_to_point).
    (Collective.SEND, Algorithm.STAR): Form(lambda p: 1, lambda p: 1.0, PARAMETER_SERVER),
    (Collective.RECV, Algorithm.STAR): Form(lambda p: 1, lambda p: 1.0, PARAMETER_SERVER),
}


def _check(collective: str, size_bytes: float, ranks: int) -> None:
    if collective not in DEFAULT_ALGORITHMS:
        raise SpecError(f"collective {collective!r} is not modelled; modelled: {', '.join(DEFAULT_ALGORITHMS)}")
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, numbers.Real) or not (
            math.isfinite(size_bytes) and size_bytes >= 0):
        raise SpecError(f"{collective} size must be a finite number of bytes >= 0, got {size_bytes!r}")
    if isinstance(ranks, bool) or not isinstance(ranks, numbers.Integral) or ranks < 1:
        raise SpecError(f"{collective} ranks must be a whole number >= 1, got {ranks!r}")


def resolve_algorithm(collective: str, algorithm: str | None,
                      known: Mapping[tuple[str, Algorithm], object]) -> Algorithm:
    """`algorithm` (the collective's default when None), checked to be one `known` models for it."""
    chosen = DEFAULT_ALGORITHMS[collective] if algorithm is None else algorithm
    allowed = [a.value for (c, a) in known if c == collective]
    if chosen not in allowed:
        raise SpecError(f"algorithm {str(chosen)!r} is not modelled for {collective} here; "
                        f"allowed: {', '.join(allowed)}")
    return Algorithm(chosen)


def one_link_time(collective: str, size_bytes: float, ranks: int, link: Link, algorithm: str | None = None) -> float:
    """Seconds for one collective of `size_bytes` among `ranks` ranks all joined by `link` (one level)."""
    _check(collective, size_bytes, ranks)
    chosen = resolve_algorithm(collective, algorithm, ONE_LINK_FORMS)
    check_applies(chosen, ranks)
    form = ONE_LINK_FORMS[(collective, chosen)]
    if ranks == 1:
        return 0.0
    return form.steps(ranks) * link.latency_s + form.bytes_factor(ranks) * size_bytes * link.seconds_per_byte


# ---- two levels: m nodes of g GPUs ------------------------------------------------------------------------


def _crossing_seconds_per_byte(layout: NodeLayout, cluster: Cluster) -> float:
    """Seconds per byte of a ring or chain that visits each node's GPUs in turn: every GPU's link inside
    its node and the node's boundary carry the same bytes, pipelined, so the slower of the two sets the
    pace (the module docstring says why the boundary runs at B_e)."""
    inside = cluster.intra_node.seconds_per_byte if layout.ranks_per_node > 1 else 0.0
    across = cluster.inter_node.seconds_per_byte if layout.nodes > 1 else 0.0
    return max(inside, across)


def _ring_latency(steps: int, inter_steps: int, cluster: Cluster) -> float:
    """NCCL's ring latency: of a chunk's `steps` hops, `inter_steps` cross a node boundary (a pipeline's
    fill time: each hop is paid once, at its own link's latency)."""
    return (steps - inter_steps) * cluster.intra_node.latency_s + inter_steps * cluster.inter_node.latency_s


def _ring_all_reduce(n: float, layout: NodeLayout, cluster: Cluster) -> float:
    # 2(p-1) steps, 2(m-1) of them across nodes (NCCL nInterSteps = 2(nNodes-1) at 01afd20 and again from
    # 2.23 on; 2.12 to 2.22 counted 2 nNodes, which goes negative on the intra-node side at one GPU per node), and
    # 2(p-1)/p n bytes through each GPU's link and each node boundary.
    p, m = layout.ranks, layout.nodes
    return (_ring_latency(2 * (p - 1), 2 * (m - 1), cluster)
            + 2 * (p - 1) / p * n * _crossing_seconds_per_byte(layout, cluster))


def _ring_all_gather(n: float, layout: NodeLayout, cluster: Cluster) -> float:
    # p-1 steps, m-1 across nodes (NCCL nInterSteps = nNodes-1); (p-1)/p n bytes. Reduce-scatter alike.
    p, m = layout.ranks, layout.nodes
    return _ring_latency(p - 1, m - 1, cluster) + (p - 1) / p * n * _crossing_seconds_per_byte(layout, cluster)


def _tree_all_reduce(n: float, layout: NodeLayout, cluster: Cluster) -> float:
    # NCCL's tree: a chain through the g GPUs of each node, a double binary tree over the m nodes, up and
    # back down: latency 2((g-1) alpha_i + log2i(m) alpha_e) (tuning.cc, NCCL_ALGO_TREE); each GPU and
    # each node boundary carries 2n (ratio .5), pipelined, so the slower link sets the pace.
    g, m = layout.ranks_per_node, layout.nodes
    latency = 2 * ((g - 1) * cluster.intra_node.latency_s + _floor_log2(m) * cluster.inter_node.latency_s)
    return latency + 2 * n * _crossing_seconds_per_byte(layout, cluster)


def _hierarchical_all_reduce(n: float, layout: NodeLayout, cluster: Cluster) -> float:
    # Horovod's hierarchical all-reduce (HOROVOD_HIERARCHICAL_ALLREDUCE; horovod/common/ops/
    # nccl_operations.cc NCCLHierarchicalAllreduce::Execute: NCCL reduce-scatter in the node, MPI
    # all-reduce across nodes, NCCL all-gather in the node): three phases, one after the other.
    # 1. ring reduce-scatter of n inside each node:  (g-1) alpha_i + (g-1)/g n / B_i
    # 2. g ring all-reduces at once, one per local rank, each of its n/g shard across the m nodes; the g
    #    of them share the node's NICs, each at B_e / g:
    #       2(m-1) alpha_e + 2(m-1)/m (n/g) / (B_e/g) = 2(m-1) alpha_e + 2(m-1)/m n / B_e
    # 3. ring all-gather of n inside each node:      (g-1) alpha_i + (g-1)/g n / B_i
    g, m = layout.ranks_per_node, layout.nodes
    inside = cluster.intra_node
    across = cluster.inter_node
    in_node = 2 * ((g - 1) * inside.latency_s + (g - 1) / g * n * inside.seconds_per_byte)
    shard = n / g
    between = 2 * (m - 1) * across.latency_s + 2 * (m - 1) / m * shard * (g * across.seconds_per_byte)
    return in_node + between


def _halving_doubling_half(n: float, layout: NodeLayout, cluster: Cluster) -> float:
    # Recursive halving reduce-scatter with the larger halves exchanged with the nearer ranks (MPICH's
    # Rabenseifner all-reduce and gloo's ReduceScatterHalvingDoubling, whose last step putting the chunks
    # in rank order is left out: partner at distance 1, 2, 4, ...):
    # step k (k = 1 .. lg p) sends n/2^k to the rank 2^(k-1) away. Packed ranks: the first lg g steps stay
    # inside the node, n/2 + ... + n/g = (g-1)/g n bytes; the last lg m cross it with all g GPUs of a node
    # at once, each at B_e / g, n/(2g) + ... + n/p = (m-1)/(m g) n bytes each:
    #     lg g alpha_i + (g-1)/g n / B_i + lg m alpha_e + (m-1)/m n / B_e
    # (the one-link lg p alpha + (p-1)/p n beta at m = 1 or g = 1). Recursive doubling all-gather, the same
    # steps in reverse, costs the same.
    g, m = layout.ranks_per_node, layout.nodes
    inside = _floor_log2(g) * cluster.intra_node.latency_s + (g - 1) / g * n * cluster.intra_node.seconds_per_byte
    across = _floor_log2(m) * cluster.inter_node.latency_s + (m - 1) / m * n * cluster.inter_node.seconds_per_byte
    return inside + across


def _halving_doubling_all_reduce(n: float, layout: NodeLayout, cluster: Cluster) -> float:
    # Rabenseifner: the reduce-scatter above, then its all-gather in reverse (Thakur et al., sec. 4.4).
    return 2 * _halving_doubling_half(n, layout, cluster)


def _chain(n: float, layout: NodeLayout, cluster: Cluster) -> float:
    # A pipelined chain through the nodes' GPUs in turn: p-1 hops, m-1 across nodes; n bytes through each
    # GPU's link and each node boundary.
    p, m = layout.ranks, layout.nodes
    return _ring_latency(p - 1, m - 1, cluster) + n * _crossing_seconds_per_byte(layout, cluster)


def _pairwise_all_to_all(n: float, layout: NodeLayout, cluster: Cluster) -> float:
    # Pairwise exchange ordered by node: round (b, s) pairs local rank j of node a with local rank
    # (j+s) mod g of node (a+b) mod m. The g-1 rounds with b = 0 stay inside the node; in each of the
    # p-g others all g GPUs of a node exchange with other nodes at once and share B_e:
    #     (g-1)(alpha_i + (n/p) / B_i) + (p-g)(alpha_e + g (n/p) / B_e)
    # (at m = 1 or g = 1 this is the one-link (p-1) alpha + (p-1)/p n beta).
    p, g = layout.ranks, layout.ranks_per_node
    piece = n / p
    inside = (g - 1) * (cluster.intra_node.latency_s + piece * cluster.intra_node.seconds_per_byte)
    across = (p - g) * (cluster.inter_node.latency_s + g * piece * cluster.inter_node.seconds_per_byte)
    return inside + across


def _server_link_message(n: float, layout: NodeLayout, cluster: Cluster) -> float:
    # One message on a parameter server's link: the servers sit on hosts of their own, so every message crosses
    # nodes, alpha_e + n / B_e (ServerLinks gives the cluster as the busier of a phase's links sees one message).
    return cluster.inter_node.latency_s + n * cluster.inter_node.seconds_per_byte


TWO_LEVEL: dict[tuple[str, Algorithm], Callable[[float, NodeLayout, Cluster], float]] = {
    (Collective.ALL_REDUCE, Algorithm.RING): _ring_all_reduce,
    (Collective.ALL_REDUCE, Algorithm.TREE): _tree_all_reduce,
    (Collective.ALL_REDUCE, Algorithm.HIERARCHICAL): _hierarchical_all_reduce,
    (Collective.ALL_REDUCE, Algorithm.HALVING_DOUBLING): _halving_doubling_all_reduce,
    (Collective.ALL_GATHER, Algorithm.RING): _ring_all_gather,
    (Collective.REDUCE_SCATTER, Algorithm.RING): _ring_all_gather,
    (Collective.ALL_GATHER, Algorithm.HALVING_DOUBLING): _halving_doubling_half,
    (Collective.REDUCE_SCATTER, Algorithm.HALVING_DOUBLING): _halving_doubling_half,
    (Collective.BROADCAST, Algorithm.CHAIN): _chain,
    (Collective.REDUCE, Algorithm.CHAIN): _chain,
    (Collective.ALL_TO_ALL, Algorithm.PAIRWISE): _pairwise_all_to_all,
    (Collective.SEND, Algorithm.CHAIN): _chain,       # 2 ranks: one hop, inside a node or across
    (Collective.RECV, Algorithm.CHAIN): lambda n, layout, cluster: 0.0,
    (Collective.SEND, Algorithm.STAR): _server_link_message,
    (Collective.RECV, Algorithm.STAR): _server_link_message,
}


def collective_time(collective: str, size_bytes: float, ranks: int, cluster: Cluster,
                    algorithm: str | None = None) -> float:
    """Seconds for one collective of `size_bytes` among `ranks` ranks packed onto `cluster`'s nodes, by
    `algorithm` (DEFAULT_ALGORITHMS[collective] when None)."""
    _check(collective, size_bytes, ranks)
    chosen = resolve_algorithm(collective, algorithm, TWO_LEVEL)
    check_applies(chosen, ranks)
    model = TWO_LEVEL[(collective, chosen)]
    layout = cluster.layout(ranks)
    return 0.0 if ranks == 1 else model(float(size_bytes), layout, cluster)


def parse_library(name: str) -> Library:
    allowed = [library.value for library in Library]
    if name not in allowed:
        raise SpecError(f"library {name!r} is not one of: {', '.join(allowed)}")
    return Library(name)


def fastest_algorithm(collective: str, size_bytes: float, ranks: int, cluster: Cluster,
                      library: str = Library.NCCL) -> tuple[Algorithm, float]:
    """The algorithm `library` can run for `collective` with the least modelled time, and that time: as
    NCCL's tuner picks by its own model (enqueue.cc: the algorithm and protocol of least predicted time);
    ties go to the one listed first in LIBRARY_ALGORITHMS (the ring)."""
    _check(collective, size_bytes, ranks)
    # Where none holds (halving-doubling alone, at a rank count not a power of two) the ring stands in.
    candidates = [a for a in LIBRARY_ALGORITHMS[parse_library(library)][collective] if applies(a, ranks)] or [
        DEFAULT_ALGORITHMS[collective]]
    timed = [(collective_time(collective, size_bytes, ranks, cluster, a), i, a) for i, a in enumerate(candidates)]
    seconds, _, best = min(timed)
    return best, seconds


class CommModel(Protocol):
    """Anything that prices one collective: a described cluster (ClusterModel) or a calibration
    (harness.project.fit.Calibration), and names the algorithm it prices it by."""

    def collective_seconds(self, collective: str, size_bytes: float, ranks: int) -> float: ...

    def algorithm(self, collective: str, size_bytes: float, ranks: int) -> str: ...


@dataclass(frozen=True, slots=True)
class ClusterModel:
    """A described cluster driven by `library`: each call priced by the least modelled time among the
    library's algorithms for its collective (fastest_algorithm), except where `algorithms` forces one
    (e.g. {"all_reduce": "hierarchical"})."""

    cluster: Cluster
    algorithms: Mapping[str, str] = field(default_factory=dict)
    library: str = Library.NCCL

    def __post_init__(self) -> None:
        unknown = sorted(set(self.algorithms) - set(DEFAULT_ALGORITHMS))
        if unknown:
            raise SpecError(f"collective {unknown[0]!r} is not modelled; modelled: {', '.join(DEFAULT_ALGORITHMS)}")
        forced = {c: resolve_algorithm(c, a, TWO_LEVEL) for c, a in self.algorithms.items()}
        if Algorithm.STAR in forced.values():
            raise SpecError("algorithm 'star' is a dedicated parameter server's layout (ps placement=dedicated), "
                            "not one to force; allowed for send and recv: chain")
        object.__setattr__(self, "algorithms", forced)
        object.__setattr__(self, "library", parse_library(str(self.library)))

    def choose(self, collective: str, size_bytes: float, ranks: int) -> tuple[Algorithm, float]:
        """(algorithm, seconds) of one call: the forced algorithm, else the library's fastest."""
        _check(collective, size_bytes, ranks)
        forced = self.algorithms.get(collective)
        if forced is None:
            return fastest_algorithm(collective, size_bytes, ranks, self.cluster, self.library)
        return forced, collective_time(collective, size_bytes, ranks, self.cluster, forced)

    def collective_seconds(self, collective: str, size_bytes: float, ranks: int) -> float:
        return self.choose(collective, size_bytes, ranks)[1]

    def algorithm(self, collective: str, size_bytes: float, ranks: int) -> str:
        return self.choose(collective, size_bytes, ranks)[0].value

    def check_ranks(self, ranks: int) -> None:
        """A one-line error where `ranks` do not fill the cluster's nodes or a forced algorithm does not
        hold at `ranks`, before anything is priced."""
        self.cluster.layout(ranks)
        for algorithm in self.algorithms.values():
            check_applies(algorithm, ranks)


@dataclass(frozen=True, slots=True)
class ServerLinks:
    """A dedicated parameter server's sends and recvs on a described cluster (Algorithm.STAR; Li et al. 2014, the
    Horovod paper sec. 2). Its S servers sit on S hosts of their own, one server a host with that node's whole link
    to the others (alpha_e, B_e); its W workers, the projection's N, fill nodes of g = min(W, gpus_per_node).
    A step has two phases that do not overlap (a server receives every gradient shard, steps its optimizer, then
    sends the parameters back); in each, a server's link carries its W messages of n = P / S bytes and a worker
    node's link its g workers' g S messages (g P). The busier link sets the pace and every message pays its
    start-up:

        phase = W alpha_e + max(W n, g S n) / B_e,   one message = alpha_e + n / B_e x max(W, g S) / W

    The busiest rank's schedule holds a server's W sends and W recvs of n a step, each priced as one message."""

    cluster: Cluster
    workers: int
    servers: int

    def __post_init__(self) -> None:
        for name, count in (("workers", self.workers), ("servers", self.servers)):
            if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
                raise SpecError(f"a parameter server's {name} must be a whole number >= 1, got {count!r}")

    @property
    def workers_per_node(self) -> int:
        return min(self.workers, self.cluster.gpus_per_node)

    def phase_bytes(self, size_bytes: float) -> tuple[float, float]:
        """(a server's link, a worker node's link): the bytes each carries in one phase of messages of `size_bytes`,
        W n and g S n."""
        return self.workers * size_bytes, self.workers_per_node * self.servers * size_bytes

    def bottleneck(self, size_bytes: float) -> str:
        """Which link sets a phase's pace: "server" (W n >= g S n, ties to the server) or "worker node"."""
        server, worker_node = self.phase_bytes(size_bytes)
        return "server" if server >= worker_node else "worker node"

    def seen_by_one_message(self) -> Cluster:
        """The cluster as one message sees it: every message crosses nodes (one rank a node), on a link of B_e x W /
        max(W, g S), the bottleneck's bytes of a phase shared out over the server's W messages."""
        share = max(self.workers, self.workers_per_node * self.servers) / self.workers
        cluster = self.cluster
        return Cluster(name=f"{cluster.name}, a parameter server's link", gpus_per_node=1,
                       intra_node=cluster.intra_node,
                       inter_node=Link(latency_s=cluster.inter_node.latency_s,
                                       bandwidth_bytes_per_s=cluster.inter_node.bandwidth_bytes_per_s / share))

    def collective_seconds(self, collective: str, size_bytes: float, ranks: int) -> float:
        """One message of `size_bytes` (a send or a recv between a worker and a server: 2 ranks)."""
        if collective not in POINT_TO_POINT:
            raise SpecError(f"a parameter server's links carry send and recv only, got {collective!r}")
        return collective_time(collective, size_bytes, 2, self.seen_by_one_message(), Algorithm.STAR)

    def algorithm(self, collective: str, size_bytes: float, ranks: int) -> str:
        return Algorithm.STAR.value
