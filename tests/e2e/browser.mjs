// Launch Debian's Chromium headless with WebGPU through SwiftShader (flags: ../shared/ENVIRONMENT.md),
// or with LES_BROWSER=firefox Debian's Firefox ESR (`apt-get install firefox-esr`) through
// puppeteer-core's WebDriver BiDi client (playwright-core's BiDi client sends a command ESR 153
// lacks, and its Juggler client needs Playwright's own Firefox build).
import { chromium } from 'playwright-core';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

export const CHROMIUM_ARGS = [
  '--enable-unsafe-webgpu', '--enable-features=Vulkan', '--use-webgpu-adapter=swiftshader',
  '--no-sandbox', '--disable-background-networking', '--disable-component-update', '--disable-sync',
  '--no-first-run', '--disable-quic',
];

// A fresh profile on disk (OPFS and its quota as a user has them; incognito storage is in memory).
// Returns a context with `newPage()` and `close()` (pages: `goto`, `evaluate(fn, arg)`, `on`).
export async function launch() {
  if (process.env.LES_BROWSER === 'firefox') return launchFirefox();
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'les-chromium-'));
  const ctx = await chromium.launchPersistentContext(dir, { executablePath: process.env.LES_CHROMIUM ?? '/usr/bin/chromium', args: CHROMIUM_ARGS, headless: true });
  const close = ctx.close.bind(ctx);
  ctx.close = async () => {
    await close();
    fs.rmSync(dir, { recursive: true, force: true });
  };
  return ctx;
}

async function launchFirefox() {
  const { default: puppeteer } = await import('puppeteer-core');
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'les-firefox-'));
  const browser = await puppeteer.launch({ browser: 'firefox', executablePath: process.env.LES_FIREFOX ?? '/usr/bin/firefox-esr', headless: true, userDataDir: dir, protocolTimeout: 600_000 });
  return {
    browserName: 'firefox',
    version: await browser.version(),
    newPage: async () => playwrightLike(await browser.newPage()),
    close: async () => {
      await browser.close();
      fs.rmSync(dir, { recursive: true, force: true });
    },
  };
}

// A puppeteer page with the few Playwright page methods the tests call (Playwright's argument
// order for `waitForFunction`; `fill`, `isVisible`, `textContent`, `setInputFiles` by selector).
function playwrightLike(page) {
  const extra = {
    waitForFunction: (fn, arg, opts = {}) => page.waitForFunction(fn, { timeout: opts.timeout ?? 30_000, polling: opts.polling ?? 100 }, arg),
    fill: (sel, v) => page.$eval(sel, (e, v) => { e.value = v; e.dispatchEvent(new Event('input', { bubbles: true })); }, v),
    isVisible: (sel) => page.$eval(sel, (e) => !!(e.offsetWidth || e.offsetHeight || e.getClientRects().length)).catch(() => false),
    textContent: (sel) => page.$eval(sel, (e) => e.textContent),
    setInputFiles: async (sel, files) => (await page.$(sel)).uploadFile(...[files].flat()),
  };
  return new Proxy(page, { get: (t, k) => (k in extra ? extra[k] : typeof t[k] === 'function' ? t[k].bind(t) : t[k]) });
}

// Run the demo page with URL parameters and wait for the generation (or an error).
export async function runDemo(page, base, params, timeout = 300_000) {
  const q = new URLSearchParams({ run: '1', ...params });
  await page.goto(`${base}/?${q}`);
  await page.waitForFunction(() => window.les && (window.les.last || window.les.error), null, { timeout, polling: 200 });
  return page.evaluate(() => ({ last: window.les.last, error: window.les.error, progress: window.les.progress, backend: window.les.engine?.backend, status: document.getElementById('status').textContent }));
}
