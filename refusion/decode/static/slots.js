/* The slot view: a decoding's generation region drawn as a row of slots, one cell per
   position, from the events of a decoding (docs/playground.md#events). The replay page of
   `refusion generate --trace` and the playground of `refusion serve` both draw with it.

   An event is {step, nfe, path, spans: [[start, length], ...], texts: [[token text, ...], ...]}.
   Commits (path "fast": global verification, "infill": parallel infilling, "ar", "mdm") fill
   cells for good, coloured by the step that committed them and marked by their phase; notes
   show what a step did besides: "plan" (the selected slots' drafts, faint), "correction" (a
   draft replaced by the AR prediction) and "rejected" (drafts thrown away, struck through). */
(function (root) {
  'use strict';

  const NOTES = ['plan', 'correction', 'rejected'];
  const PHASES = {
    plan: 'plan (the slots it selected, drafts)',
    fast: 'global verification',
    infill: 'parallel infilling',
    correction: 'correction (AR prediction)',
    rejected: 'rejected draft',
    ar: 'AR',
    mdm: 'MDM',
  };

  function stepColour(step) {
    return 'hsl(' + Math.round((step * 137.508) % 360) + ', 70%, 84%)';
  }

  class SlotView {
    /* `root`: the element to draw into; `length`: positions of the region; `slotSize`:
       tokens per slot (1 draws one cell per slot, as AR decodes). */
    constructor(root, length, slotSize) {
      this.root = root;
      this.reset(length, slotSize);
    }

    reset(length, slotSize) {
      this.length = Math.max(0, length | 0);
      this.slotSize = Math.max(1, slotSize | 0);
      this.cells = [];
      for (let i = 0; i < this.length; i++) this.cells.push({});
      this.step = -1;
      this.nfe = 0;
      this.committed = 0;
      this.counts = [];  // per step: what each phase did (see summary)
      this.draw();
    }

    /* The decoding finished: drafts that were never committed are no longer shown. */
    settle() {
      for (const c of this.cells) c.draft = c.rejected = undefined;
      this.draw();
    }

    /* What step `step` did, in words: "plan 3 slots · global verification 8 tokens · ...". */
    summary(step) {
      const c = this.counts[step];
      if (!c) return '';
      return Object.entries(c).map(([path, n]) => (PHASES[path] || path).split(' (')[0] + ' ' + n +
        (path === 'plan' ? (n === 1 ? ' slot' : ' slots') : (n === 1 ? ' token' : ' tokens'))).join(' \u00b7 ');
    }

    /* Apply events in order (the next ones of a stream, or a replay's). */
    add(events) {
      for (const ev of events) this.apply(ev);
      this.draw();
    }

    /* Every event of a finished decoding up to (not including) step `upto`. */
    replay(events, upto) {
      this.reset(this.length, this.slotSize);
      this.add(events.filter((ev) => ev.step < upto));
    }

    apply(ev) {
      if (ev.step > this.step) {
        // a new step: the drafts of earlier ones that were not committed are stale
        for (const c of this.cells) c.draft = c.rejected = undefined;
        this.step = ev.step;
      }
      this.nfe = Math.max(this.nfe, ev.nfe);
      const note = NOTES.includes(ev.path);
      const counts = this.counts[ev.step] || (this.counts[ev.step] = {});
      counts[ev.path] = (counts[ev.path] || 0) +
        (ev.path === 'plan' ? ev.spans.length : ev.spans.reduce((a, s) => a + s[1], 0));
      ev.spans.forEach(([start, n], k) => {
        const texts = ev.texts[k];
        for (let i = 0; i < n; i++) {
          const pos = start + i;
          while (pos >= this.cells.length) this.cells.push({});
          const c = this.cells[pos];
          if (!note) {
            if (c.text === undefined) this.committed++;
            if (c.corrected !== ev.step) c.corrected = undefined;  // corrected in this step, or not
            c.text = texts[i];
            c.step = ev.step;
            c.path = ev.path;
            c.draft = c.rejected = undefined;
          } else if (c.text === undefined) {
            if (ev.path === 'rejected') {
              c.rejected = texts[i];
              c.draft = undefined;
            } else {
              c.draft = texts[i];
              c.rejected = undefined;
              if (ev.path === 'correction') c.corrected = ev.step;
              if (ev.path === 'plan') c.planned = ev.step;
            }
          }
        }
      });
    }

    draw() {
      const grid = document.createElement('div');
      grid.className = this.slotSize === 1 ? 'slots flat' : 'slots';  // AR: no slots to box
      let slot = null;
      this.cells.forEach((c, pos) => {
        if (pos % this.slotSize === 0) {
          slot = document.createElement('div');
          slot.className = 'slot';
          slot.dataset.slot = String(pos / this.slotSize);
          grid.appendChild(slot);
        }
        slot.appendChild(this.cell(c, pos));
      });
      this.root.replaceChildren(grid);
    }

    cell(c, pos) {
      const el = document.createElement('span');
      const cls = ['cell'];
      let title = 'position +' + pos;
      el.dataset.pos = String(pos);
      if (c.text !== undefined) {
        cls.push('done', 'p-' + c.path);
        el.style.background = stepColour(c.step);
        el.textContent = show(c.text);
        el.dataset.step = String(c.step);
        el.dataset.phase = c.path;
        title += ', step ' + c.step + ', ' + PHASES[c.path];
        if (c.step === this.step) cls.push('newest');
        if (c.corrected !== undefined) {
          cls.push('corrected');
          title += ', corrected';
        }
      } else if (c.draft !== undefined) {
        cls.push('draft');
        if (c.corrected !== undefined) cls.push('corrected');
        el.textContent = show(c.draft);
        title += ', draft';
      } else if (c.rejected !== undefined) {
        cls.push('rejected');
        el.textContent = show(c.rejected);
        title += ', rejected draft';
      } else {
        el.textContent = '\u00b7';
      }
      el.className = cls.join(' ');
      el.title = title;
      return el;
    }

    /* The committed text, cell by cell (what the view shows, for a reader or a test). */
    text() {
      return this.cells.map((c) => (c.text === undefined ? '' : c.text)).join('');
    }
  }

  function show(text) {
    return text === '' ? '\u2205' : text.replace(/\n/g, '\u21b5');
  }

  /* The legend both pages show under their views. */
  SlotView.legend = function () {
    const box = document.createElement('div');
    box.className = 'slot-legend';
    for (const p of ['fast', 'infill', 'ar', 'mdm']) {
      const s = document.createElement('span');
      s.className = 'cell done p-' + p;
      s.textContent = PHASES[p];
      box.appendChild(s);
    }
    for (const [cls, label] of [['draft', 'planned draft'], ['draft corrected', 'corrected'],
                                ['rejected', 'rejected draft'], ['done newest', 'latest step']]) {
      const s = document.createElement('span');
      s.className = 'cell ' + cls;
      s.textContent = label;
      box.appendChild(s);
    }
    const note = document.createElement('span');
    note.className = 'slot-legend-note';
    note.textContent = 'the colour of a committed token is its step';
    box.appendChild(note);
    return box;
  };

  SlotView.PHASES = PHASES;
  SlotView.NOTES = NOTES;
  SlotView.stepColour = stepColour;
  root.SlotView = SlotView;
})(typeof window !== 'undefined' ? window : globalThis);
