/**
 * alpa-lab: the JupyterLab side of alpa_lab.
 *
 * - `alpa-lab:new-workbench` (Launcher card "alpa_lab workbench", category Notebook; command
 *   palette): a new notebook on the python3 kernel, pre-filled with a starter that loads the
 *   `%%parallelize` magic, builds the example MLP, plans and runs its training step.
 * - `alpa-lab:insert-parallelize` (command palette, category alpa_lab; notebook cell context
 *   menu): a `%%parallelize` template cell below the active cell.
 *
 * Cells starting with `%%parallelize` need no editor support: JupyterLab's ipython mode parses
 * the whole cell as Python, so the step below the magic line is highlighted as Python.
 * Nothing here talks to the kernel, so the extension works whether or not the kernel can import
 * alpa_lab (the starter's first code cell then fails with an ImportError that says so).
 */

import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { IDefaultFileBrowser } from '@jupyterlab/filebrowser';
import { ILauncher } from '@jupyterlab/launcher';
import {
  INotebookTracker,
  NotebookActions,
  NotebookPanel
} from '@jupyterlab/notebook';
import { LabIcon } from '@jupyterlab/ui-components';

import { PARALLELIZE_TEMPLATE, starterNotebook } from './starter';

/** Command ids, also usable from `window.jupyterapp.commands.execute(...)`. */
export namespace CommandIDs {
  export const newWorkbench = 'alpa-lab:new-workbench';
  export const insertParallelize = 'alpa-lab:insert-parallelize';
}

const PALETTE_CATEGORY = 'alpa_lab';
const WORKBENCH_NAME = 'alpa_lab_workbench';

/** A 2x4 device mesh: the launcher card's and the commands' icon. */
const meshIcon = new LabIcon({
  name: 'alpa-lab:mesh',
  svgstr: `<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16">
  <g class="jp-icon3" fill="#616161">
    <rect x="2" y="5" width="4" height="5" rx="1"/><rect x="8" y="5" width="4" height="5" rx="1"/>
    <rect x="14" y="5" width="4" height="5" rx="1"/><rect x="20" y="5" width="2.5" height="5" rx="1"/>
    <rect x="2" y="14" width="4" height="5" rx="1"/><rect x="8" y="14" width="4" height="5" rx="1"/>
    <rect x="14" y="14" width="4" height="5" rx="1"/><rect x="20" y="14" width="2.5" height="5" rx="1"/>
  </g>
</svg>`
});

/** `dir/alpa_lab_workbench.ipynb`, or `-1`, `-2`, ... when that is taken. */
async function freshPath(app: JupyterFrontEnd, dir: string): Promise<string> {
  const listing = await app.serviceManager.contents.get(dir, { content: true });
  const taken = new Set<string>(
    Array.isArray(listing.content)
      ? listing.content.map((item: { name: string }) => item.name)
      : []
  );
  let name = `${WORKBENCH_NAME}.ipynb`;
  for (let i = 1; taken.has(name); i++) {
    name = `${WORKBENCH_NAME}-${i}.ipynb`;
  }
  return dir ? `${dir}/${name}` : name;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'alpa-lab:plugin',
  description:
    'alpa_lab workbench: a starter notebook and a %%parallelize cell command',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ILauncher, ICommandPalette, IDefaultFileBrowser],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    launcher: ILauncher | null,
    palette: ICommandPalette | null,
    browser: IDefaultFileBrowser | null
  ) => {
    const { commands } = app;

    commands.addCommand(CommandIDs.newWorkbench, {
      label: args => (args['isLauncher'] ? 'alpa_lab workbench' : 'New alpa_lab Workbench'),
      caption:
        'A new notebook that plans and runs a training step with %%parallelize',
      icon: args => (args['isPalette'] ? undefined : meshIcon),
      execute: async args => {
        const dir =
          typeof args['cwd'] === 'string'
            ? args['cwd']
            : (browser?.model.path ?? '');
        const path = await freshPath(app, dir);
        await app.serviceManager.contents.save(path, {
          type: 'notebook',
          format: 'json',
          content: starterNotebook()
        });
        return commands.execute('docmanager:open', {
          path,
          factory: 'Notebook',
          kernel: { name: 'python3' }
        });
      }
    });

    commands.addCommand(CommandIDs.insertParallelize, {
      label: 'Insert %%parallelize cell',
      caption:
        'Insert a %%parallelize cell below the active cell: a training step, planned with state and batch',
      icon: args => (args['isPalette'] ? undefined : meshIcon),
      isEnabled: () => tracker.currentWidget !== null,
      execute: () => {
        const panel: NotebookPanel | null = tracker.currentWidget;
        if (!panel) {
          return;
        }
        const notebook = panel.content;
        NotebookActions.insertBelow(notebook);
        if (notebook.activeCell?.model.type !== 'code') {
          NotebookActions.changeCellType(notebook, 'code');
        }
        notebook.activeCell?.model.sharedModel.setSource(PARALLELIZE_TEMPLATE);
      }
    });

    if (launcher) {
      launcher.add({
        command: CommandIDs.newWorkbench,
        category: 'Notebook',
        rank: 50,
        args: { isLauncher: true }
      });
    }
    if (palette) {
      palette.addItem({
        command: CommandIDs.newWorkbench,
        category: PALETTE_CATEGORY,
        args: { isPalette: true }
      });
      palette.addItem({
        command: CommandIDs.insertParallelize,
        category: PALETTE_CATEGORY,
        args: { isPalette: true }
      });
    }
    app.contextMenu.addItem({
      command: CommandIDs.insertParallelize,
      selector: '.jp-Notebook .jp-Cell',
      rank: 12
    });
  }
};

export default plugin;
