"""An objective's loss returns a (Mean, Aux) pair; anything else is refused by name as the step is
traced. A bare mean, a float or a dict of metrics failed deep in the step with a TypeError or an
AttributeError about tracers ('iteration over a 0-d array', 'LinearizeTracer has no attribute
total')."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

from dew import Trainer
from dew.errors import LossReturnError, ObjectiveSignatureError
from dew.objectives.base import Aux, Mean
from tiny_objective import DATA, Tiny  # every test folder is on sys.path (conftest.py)


class Returns(Tiny):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def loss(self, variables, batch, step):
        errors = (self.model.apply(variables, batch["x"]) - 1.0) ** 2
        return {"bare": lambda: jnp.mean(errors),
                "no mean": lambda: (jnp.mean(errors), Aux()),
                "float": lambda: (1.0, Aux()),
                "dict aux": lambda: (Mean.of(errors), {"mse": jnp.mean(errors)}),
                "pair": lambda: (Mean.of(errors), Aux())}[self.kind]()


@pytest.mark.parametrize("kind, said", [("bare", "returned (an array)"), ("no mean", "returned (an array, Aux)"),
                                        ("float", "returned (float, Aux)"), ("dict aux", "returned (Mean, dict)")])
def test_a_loss_that_returns_no_mean_and_aux_is_refused_naming_what_it_returned(kind, said):
    with pytest.raises(LossReturnError, match=r"Returns\.loss " + said.replace("(", r"\(").replace(")", r"\)")
                       + r"; a loss returns a \(Mean, Aux\) pair"):
        Trainer(Returns(kind), optax.sgd(0.1), key=jax.random.key(0)).fit(DATA, steps=1)
    state = Trainer(Returns("pair"), optax.sgd(0.1), key=jax.random.key(0)).fit(DATA, steps=1)
    assert int(state.step) == 1



class NoStep(Tiny):
    def loss(self, variables, batch):  # a plugin's loss that leaves out step
        return Mean.of((self.model.apply(variables, batch["x"]) - 1.0) ** 2), Aux()


class NoVariables(Tiny):
    def init(self, key):
        return super().init(key)


class RaisesInside(Tiny):
    def loss(self, variables, batch, step):
        raise TypeError("the loss's own mistake")


def test_a_loss_or_init_that_cannot_take_the_trainers_arguments_is_refused_naming_its_signature():
    with pytest.raises(ObjectiveSignatureError, match=r"NoStep\.loss\(variables, batch\) cannot be called as the "
                       r"trainer calls it, with 3 argument\(s\) \(.*takes 3 positional.*\): declare it as "
                       r"`def loss\(self, variables, batch, step\)`"):
        Trainer(NoStep(), optax.sgd(0.1), key=jax.random.key(0)).fit(DATA, steps=1)
    # An init without variables serves a fresh run, and is refused by name for one that starts from weights.
    fresh = Trainer(NoVariables(), optax.sgd(0.1), key=jax.random.key(0))
    weights = fresh.fit(DATA, steps=1).params
    with pytest.raises(ObjectiveSignatureError, match=r"NoVariables\.init\(key\) cannot be called as the trainer "
                       r"calls it, with 2 argument\(s\).*`def init\(self, key, variables=None\)`"):
        Trainer(NoVariables(), optax.sgd(0.1), key=jax.random.key(0), initializer=weights).fit(DATA, steps=1)
    # A TypeError from inside a loss that takes them is the loss's own, and stays as it is.
    with pytest.raises(TypeError, match="the loss's own mistake") as caught:
        Trainer(RaisesInside(), optax.sgd(0.1), key=jax.random.key(0)).fit(DATA, steps=1)
    assert not isinstance(caught.value, ObjectiveSignatureError)
