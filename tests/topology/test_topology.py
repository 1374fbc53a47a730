import math

import jax.numpy as jnp
import networkx as nx
import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings, strategies as st

import gossipjax as gj
from gossipjax import topology as T

STATIC = [T.ring(8), T.torus(3, 4), T.exponential(16), T.exponential(12), T.hypercube(8), T.complete(5),
          T.erdos_renyi(12, 0.4, seed=3), T.grid(3, 3, weights="metropolis"), T.star(6, weights="metropolis")]


@pytest.mark.parametrize("topo", STATIC, ids=lambda t: t.name)
def test_static_families_are_doubly_stochastic_and_plan_equals_dense(topo):
  w = topo.matrix()
  np.testing.assert_allclose(w.sum(0), 1, atol=1e-12)
  np.testing.assert_allclose(w.sum(1), 1, atol=1e-12)
  topo.check("doubly")
  np.testing.assert_allclose(topo.plans()[0].dense(), w, atol=1e-15)
  for r in topo.plans()[0].rounds:  # every round is a partial permutation
    senders = r.src[r.weight > 0]
    assert len(set(senders.tolist())) == len(senders)


def test_ring_uses_blueFog_uniform_weights():
  w = T.ring(6).matrix()
  assert w[0, 0] == pytest.approx(1 / 3) and w[0, 1] == pytest.approx(1 / 3) and w[0, 5] == pytest.approx(1 / 3)
  assert w[0, 2] == 0
  assert len(T.ring(6).plans()[0].rounds) == 2  # one shift each way


@pytest.mark.parametrize("n", [4, 8, 16, 32, 64, 128])
def test_exponential_rho_matches_closed_form(n):
  assert T.rho(T.exponential(n)) == pytest.approx(1 - 2 / (1 + math.log2(n)), abs=1e-12)
  assert T.exponential(n).max_degree() == int(math.log2(n))
  assert len(T.exponential(n).plans()[0].rounds) == int(math.log2(n))


def test_exponential_receives_from_powers_of_two():
  w = T.exponential(8).matrix()
  assert set(np.flatnonzero(w[3]).tolist()) == {3, 4, 5, 7}
  np.testing.assert_allclose(w[3][w[3] > 0], 0.25)


def test_ring_rho_tends_to_one():
  rhos = [T.rho(T.ring(n)) for n in (8, 16, 32, 64)]
  assert all(a < b for a, b in zip(rhos, rhos[1:])) and rhos[-1] > 0.99


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64])
def test_one_peer_exponential_period_product_is_exact_average(n):
  topo = T.one_peer_exponential(n)
  assert topo.period == int(math.log2(n)) and topo.is_time_varying == (n > 2)
  prod = np.eye(n)
  for k in range(topo.period):
    w = topo.matrix(k)
    assert (w > 0).sum(axis=1).max() == 2  # one peer per step
    prod = w @ prod
  np.testing.assert_allclose(prod, np.full((n, n), 1 / n), atol=1e-14)
  np.testing.assert_array_equal(topo.matrix(topo.period), topo.matrix(0))


def test_hypercube_uses_log_n_xor_rounds():
  topo = T.hypercube(16)
  assert len(topo.plans()[0].rounds) == 4
  assert T.rho(topo) == pytest.approx(1 - 2 / 5)


def test_torus_and_grid_weights():
  assert T.torus(4, 4).matrix()[0, 0] == pytest.approx(1 / 5)
  g = T.grid(3, 3)  # uniform weights: rows sum to 1, columns do not
  np.testing.assert_allclose(g.matrix().sum(1), 1)
  with pytest.raises(ValueError, match="metropolis"):
    g.check("doubly")


def test_networkx_and_adjacency_agree():
  g = nx.cycle_graph(7)
  np.testing.assert_allclose(T.from_networkx(g).matrix(), T.ring(7).matrix())
  np.testing.assert_allclose(T.from_adjacency(nx.to_numpy_array(g)).matrix(), T.ring(7).matrix())
  np.testing.assert_allclose(T.as_topology(g).matrix(), T.ring(7).matrix())
  tx = gj.gossip_sgd(g, learning_rate=0.1)  # a graph is accepted where a topology is
  assert tx is not None


@pytest.mark.parametrize(
    "w, match",
    [
        (np.array([[0.5, np.nan], [0.5, 0.5]]), "non-finite entry W\\[0, 1\\]"),
        (np.array([[1.5, -0.5], [0.5, 0.5]]), "negative weight W\\[0, 1\\]"),
        (np.array([[0.5, 0.4], [0.5, 0.5]]), "row 0 sums to 0.9"),
        (np.array([[0.7, 0.3], [0.5, 0.5]]), "column 0 sums to 1.2"),
        (np.eye(3), "not connected"),
        (np.ones((2, 3)), "square"),
    ],
)
def test_bad_matrices_raise_saying_what_is_wrong(w, match):
  with pytest.raises(ValueError, match=match):
    gj.gossip_sgd(T.from_matrix(w), learning_rate=0.1)


def test_matrices_of_different_sizes_and_empty_graphs_are_named():
  with pytest.raises(ValueError, match=r"from_matrix: every step's W must be of the same n x n, got \(4, 4\) at "
                                       r"step 0 and \(5, 5\) at step 1"):
    T.from_matrix([np.full((4, 4), 0.25), np.full((5, 5), 0.2)])
  with pytest.raises(ValueError, match="rows of W must be of one length, got 1 in row 0 and 2 in row 1"):
    T.from_matrix([[1.0], [0.5, 0.5]])
  with pytest.raises(ValueError, match="from_networkx: the graph has no node"):
    T.from_networkx(nx.Graph())
  with pytest.raises(TypeError, match=r"^gj\.topology\.from_networkx: the graph's node names cannot be sorted "
                                      r"\(they mix int, str\).*convert_node_labels_to_integers"):
    T.from_networkx(nx.Graph([("a", 1), (1, 2)]))


def test_bad_sizes_raise():
  for bad in (0, -3, 2.5, True):
    with pytest.raises(ValueError, match="number of nodes"):
      T.ring(bad)
  with pytest.raises(ValueError, match="power of 2"):
    T.hypercube(12)
  with pytest.raises(ValueError, match="disconnected"):
    T.erdos_renyi(30, 0.01, seed=0)


@st.composite
def random_graphs(draw):
  n = draw(st.integers(2, 14))
  seed = draw(st.integers(0, 10_000))
  rng = np.random.default_rng(seed)
  upper = np.triu(rng.random((n, n)) < draw(st.floats(0.2, 0.9)), k=1)
  ring = np.roll(np.eye(n, dtype=bool), 1, axis=1)  # a ring inside keeps it connected
  adj = upper | upper.T | ring | ring.T
  return adj


@settings(max_examples=40, deadline=None)
@given(random_graphs())
def test_random_graphs_metropolis_doubly_stochastic_and_sparse_plan_is_exact(adj):
  topo = T.from_adjacency(adj, weights="metropolis")
  topo.check("doubly")
  plan = topo.plans()[0]
  np.testing.assert_allclose(plan.dense(), topo.matrix(), atol=1e-15)
  assert len(plan.rounds) <= 2 * topo.max_degree() - 1
  assert T.rho(topo) < 1


def test_exponential_edges_run_as_documented_against_bluefog():
  """exponential: node i receives from i + 2^k; BlueFog's ExponentialTwoGraph (i - 2^k) is directed_exponential."""
  from gossipjax import topology as T

  def senders(topo, step=0):
    return set(np.flatnonzero(topo.matrix(step)[0]).tolist()) - {0}

  assert senders(T.exponential(8)) == {1, 2, 4}
  assert senders(T.directed_exponential(8)) == {4, 6, 7}
  np.testing.assert_array_equal(T.directed_exponential(8).matrix(), T.exponential(8).matrix().T)
  assert [senders(T.one_peer_exponential(8), k) for k in range(3)] == [{1}, {2}, {4}]
  assert [senders(T.one_peer_directed_exponential(8), k) for k in range(3)] == [{7}, {6}, {4}]


@pytest.mark.parametrize("value", ["rows", "col", "", None, "Doubly"])
def test_a_misspelled_stochastic_is_refused_by_check_and_make_mixer(value):
  with pytest.raises(ValueError, match=r"stochastic must be one of 'row', 'column', 'doubly' or 'none', got"):
    T.ring(4).check(value)
  with pytest.raises(ValueError, match="stochastic must be one of"):
    gj.mixing.make_mixer(T.ring(4), stochastic=value)


# A directed cycle 0 -> 1 -> 2 -> 3 -> 0 with the chords 0 -> 2 and 1 -> 3 ([i, j]: i receives from j).
DIRECTED = np.array([[0, 0, 0, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0]])


def test_push_weights_split_each_senders_value_over_itself_and_its_out_neighbours():
  w = T.weights_from_adjacency(DIRECTED, "push")
  out_degree = DIRECTED.sum(axis=0)
  np.testing.assert_allclose(w.sum(axis=0), 1, atol=1e-15)  # column stochastic on a directed graph
  np.testing.assert_allclose(np.diag(w), 1 / (out_degree + 1), atol=1e-15)
  np.testing.assert_allclose(w[DIRECTED > 0], (1 / (out_degree + 1))[np.nonzero(DIRECTED)[1]], atol=1e-15)
  np.testing.assert_allclose(T.weights_from_adjacency(sp.csr_array(DIRECTED), "push").toarray(), w, atol=1e-15)
  topo = T.from_adjacency(DIRECTED, weights="push").check("column")
  np.testing.assert_allclose(topo.matrix(), w, atol=1e-15)
  # On a regular undirected graph the push rule is the uniform one.
  np.testing.assert_allclose(T.from_adjacency(T.ring(6).matrix() > 0, weights="push").matrix(), T.ring(6).matrix())
  # Push-sum on it reaches the exact average of the initial values.
  tx = gj.sgp(topo, learning_rate=0.1)
  x = jnp.arange(4.0)[:, None]
  state = tx.init(x)
  for _ in range(200):
    u, state = tx.update(jnp.zeros_like(x), state, x)
    x = x + u
  np.testing.assert_allclose(x[:, 0], 1.5, atol=1e-10)


def test_a_failed_check_points_to_what_works_for_the_graph_at_hand():
  directed = T.from_adjacency(DIRECTED)  # uniform: row stochastic only
  with pytest.raises(ValueError, match=r"directed graph.*gj\.sgp.*weights='push'.*stochastic='row' \| 'column'") as e:
    gj.gradient_tracking(directed, learning_rate=0.1)
  assert "metropolis" not in str(e.value)
  with pytest.raises(ValueError, match=r"column \d sums to .*build the topology with weights='push'"):
    directed.check("column")
  with pytest.raises(ValueError, match=r"row \d sums to .*build the topology with weights='uniform'"):
    T.from_adjacency(DIRECTED, weights="push").check("row")
  with pytest.raises(ValueError, match="metropolis weights need an undirected graph.*weights='push'"):
    T.from_adjacency(DIRECTED, weights="metropolis")
  with pytest.raises(ValueError, match="uniform weights are only doubly stochastic on regular graphs.*metropolis"):
    T.grid(3, 3).check("doubly")
  # A matrix of one's own: no weight rule to switch, so say what to change in it.
  own = T.from_matrix(T.grid(3, 3).matrix())
  with pytest.raises(ValueError, match=r"the weights are your own: make every column sum to 1, or take "
                                       r"gj.topology.from_adjacency\(W != 0, weights='metropolis'\)"):
    own.check("doubly")
  with pytest.raises(ValueError, match=r"the weights are your own: make every column sum to 1; on a directed graph"):
    T.from_matrix(T.weights_from_adjacency(DIRECTED)).check("doubly")
