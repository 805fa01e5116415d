/* Slow motion for the playground (docs/playground.md#slow-motion): a finished decoding's
   recorded steps (the slot events of each streamed chunk, stamped with the server's seconds
   since the request started decoding) drawn again in the page at a chosen pace: at the
   recorded speed, slowed ten or fifty times, or one step per click. Nothing is asked of the
   server again, so what is shown is what it did. A race replays both lanes on one clock,
   so the lane that finished first still finishes first. */
(function (root) {
  'use strict';

  const PACES = [
    ['live', 'live (no replay)'],
    ['1', 'replay at 1x'],
    ['10', 'replay 10x slower'],
    ['50', 'replay 50x slower'],
    ['step', 'step by step'],
  ];

  function button(text, title) {
    const b = document.createElement('button');
    b.type = 'button';
    b.textContent = text;
    b.title = title;
    b.disabled = true;
    return b;
  }

  class Replay {
    /* `box`: where the controls go; `lanes`: each {view (a SlotView), step (an element
       for the step's summary), frames: [{t, events}] recorded as the chunks came}. */
    constructor(box, lanes) {
      this.lanes = lanes;
      this.frames = [];  // every lane's frames on one clock: {lane, t, events}
      this.k = 0;  // frames drawn
      this.timer = null;
      const label = document.createElement('label');
      label.textContent = 'pace ';
      this.pace = document.createElement('select');
      this.pace.className = 'pace';
      for (const [value, text] of PACES) this.pace.add(new Option(text, value));
      label.appendChild(this.pace);
      this.play = button('\u25b6 replay', 'draw the recorded steps again at this pace');
      this.back = button('\u25c0', 'one step back');
      this.fwd = button('\u25b6|', 'one step on');
      this.play.className = 'play';
      this.back.className = 'back';
      this.fwd.className = 'fwd';
      this.where = document.createElement('span');
      this.where.className = 'where muted';
      box.replaceChildren(label, this.play, this.back, this.fwd, this.where);
      this.play.onclick = () => this.start();
      this.back.onclick = () => this.go(this.k - 1);
      this.fwd.onclick = () => this.go(this.k + 1);
      this.pace.onchange = () => { if (this.frames.length && this.pace.value !== 'live') this.start(); };
    }

    /* A new decoding starts: the last one's frames are gone. */
    clear() {
      this.stop();
      for (const lane of this.lanes) lane.frames = [];
      this.frames = [];
      this.where.textContent = '';
      for (const b of [this.play, this.back, this.fwd]) b.disabled = true;
    }

    /* The decodings finished: replay them at the chosen pace, unless it is live. */
    finished() {
      this.frames = this.lanes
        .flatMap((lane, i) => lane.frames.map((f) => ({ lane: i, t: f.t, events: f.events })))
        .sort((a, b) => a.t - b.t);
      this.k = this.frames.length;
      this.play.disabled = !this.frames.length;
      if (this.frames.length && this.pace.value !== 'live') this.start();
    }

    start() {
      this.stop();
      this.go(0);
      const slower = Number(this.pace.value);
      if (Number.isFinite(slower)) this.tick(slower);
    }

    tick(slower) {
      if (this.k >= this.frames.length) return;
      const f = this.frames;
      const wait = (f[this.k].t - (this.k ? f[this.k - 1].t : 0)) * slower * 1000;
      this.timer = setTimeout(() => { this.go(this.k + 1); this.tick(slower); }, Math.max(0, wait));
    }

    stop() {
      clearTimeout(this.timer);
      this.timer = null;
    }

    /* Draw the first `k` frames of every lane. */
    go(k) {
      const n = this.frames.length;
      this.k = Math.max(0, Math.min(n, k));
      const shown = this.frames.slice(0, this.k);
      this.lanes.forEach((lane, i) => {
        lane.view.replay(shown.filter((f) => f.lane === i).flatMap((f) => f.events), Infinity);
        if (this.k === n) lane.view.settle();
        lane.step.textContent = Replay.stepLine(lane.view);
      });
      const t = this.k ? shown[this.k - 1].t : 0;
      this.where.textContent = 'frame ' + this.k + ' / ' + n + ' \u00b7 ' + t.toFixed(3) + ' s of ' +
        (n ? this.frames[n - 1].t : 0).toFixed(3) + ' s on the server';
      const stepping = this.pace.value === 'step';
      this.back.disabled = !stepping || this.k === 0;
      this.fwd.disabled = !stepping || this.k === n;
    }
  }

  /* The latest step of a view and what it did, in words. */
  Replay.stepLine = function (view) {
    return view.step >= 0 ? 'step ' + (view.step + 1) + ': ' + view.summary(view.step) : '';
  };

  root.Replay = Replay;
})(typeof window !== 'undefined' ? window : globalThis);
