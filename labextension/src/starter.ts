/**
 * What the extension writes into notebooks: the workbench starter and the %%parallelize
 * template cell. The code is the README's "In a notebook" recipe on the example MLP, and
 * every cell runs as is on the local simulated cluster (8 CPU devices).
 */

import type { INotebookContent, MultilineString } from '@jupyterlab/nbformat';
import { UUID } from '@lumino/coreutils';

/** The template cell the `alpa-lab:insert-parallelize` command inserts. */
export const PARALLELIZE_TEMPLATE = `%%parallelize --cluster local:2x4 --args state,batch --name plan
def train_step(state, batch):
    # (state, batch) -> (new_state, loss), pure JAX; take gradients with al.value_and_grad
    # so the planner sees where the backward pass ends. Every option: %%parallelize?
    grad_fn = al.value_and_grad(loss_fn, has_aux=True)
    (loss, model_state), grads = grad_fn(state.params, state.model_state, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state._replace(params=params, opt_state=opt_state, model_state=model_state), loss`;

const INTRO = `# alpa_lab workbench

Plan a JAX training step over a cluster of devices with Alpa's automatic parallelization
planner, read the plan, and run the step sharded.

1. \`%load_ext alpa_lab\` registers the \`%%parallelize\` cell magic. Loading it before JAX is
   imported gives this kernel 8 simulated CPU devices (unless \`XLA_FLAGS\` already sets a
   count); if JAX was imported first, restart the kernel.
2. The example below is a small MLP regression model trained with Adam. Its \`state\` and
   \`batch\` are what the planner traces the step with.
3. The \`%%parallelize\` cell defines \`train_step\`, plans it on \`local:2x4\` (2 hosts x 4
   simulated devices), binds the plan to \`plan\` and shows its summary. Calling
   \`train_step(state, batch)\` then runs the plan.

If \`%load_ext alpa_lab\` fails, this kernel cannot import the \`alpa_lab\` package: install
it into the kernel's environment (\`pip install -e .\` in the repository, or \`make lab\`).`;

const NEXT = `## Next

- \`print(plan.explain("dot_general_3"))\`: every strategy the planner weighed for an op, with its cost.
- \`plan2 = plan.pin(op="dot_general_3", strategy="RS1 = RR x RS1")\`, then \`print(plan2.diff(plan))\`
  and \`train_step.use(plan2)\`.
- \`%%parallelize --cluster local:2x4 --microbatches 4 --schedule 1f1b --layers 4 ...\`: a pipelined plan.
- Bigger models: \`from alpa_lab.models import make_gpt, GPTConfig\`; \`ex = make_gpt(GPTConfig())\`.
- Insert another \`%%parallelize\` cell: command palette, *alpa_lab: Insert %%parallelize cell*,
  or the cell's context menu.`;

const SETUP = `import jax
import optax

import alpa_lab as al
from alpa_lab.models import MLPConfig, make_mlp

ex = make_mlp(MLPConfig())        # 3 hidden layers of 64, batch 8, MSE loss, Adam
state, batch = ex.state, ex.batch  # TrainState(params, opt_state, model_state); {"x": ..., "y": ...}
loss_fn, optimizer = ex.loss_fn, ex.optimizer  # (params, model_state, batch) -> (loss, model_state); optax.adam
print(f"JAX sees {len(jax.devices())} {jax.devices()[0].platform} devices")`;

const RUN = `for i in range(3):
    state, loss = train_step(state, batch)  # runs the plan, sharded over the cluster's devices
    print(f"step {i}: loss {float(loss):.6f}")`;

const COLLECTIVES = 'print(plan.compare_collectives(train_step.compiled_hlo(state, batch)))';

function lines(text: string): MultilineString {
  const parts = text.split('\n');
  return parts.map((line, i) => (i < parts.length - 1 ? line + '\n' : line));
}

function code(text: string) {
  return {
    cell_type: 'code' as const,
    id: UUID.uuid4(),
    execution_count: null,
    metadata: {},
    outputs: [],
    source: lines(text)
  };
}

function markdown(text: string) {
  return {
    cell_type: 'markdown' as const,
    id: UUID.uuid4(),
    metadata: {},
    source: lines(text)
  };
}

/** The starter notebook (nbformat 4) for a python3 kernel. */
export function starterNotebook(): INotebookContent {
  return {
    cells: [
      markdown(INTRO),
      code('%load_ext alpa_lab'),
      code(SETUP),
      code(PARALLELIZE_TEMPLATE),
      code(RUN),
      code(COLLECTIVES),
      markdown(NEXT)
    ],
    metadata: {
      kernelspec: {
        display_name: 'Python 3 (ipykernel)',
        language: 'python',
        name: 'python3'
      },
      language_info: { name: 'python' }
    },
    nbformat: 4,
    nbformat_minor: 5
  };
}
