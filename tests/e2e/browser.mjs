// Launch Debian's Chromium headless with WebGPU through SwiftShader (flags: ../shared/ENVIRONMENT.md).
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
export async function launch() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'les-chromium-'));
  const ctx = await chromium.launchPersistentContext(dir, { executablePath: process.env.LES_CHROMIUM ?? '/usr/bin/chromium', args: CHROMIUM_ARGS, headless: true });
  const close = ctx.close.bind(ctx);
  ctx.close = async () => {
    await close();
    fs.rmSync(dir, { recursive: true, force: true });
  };
  return ctx;
}

// Run the demo page with URL parameters and wait for the generation (or an error).
export async function runDemo(page, base, params, timeout = 300_000) {
  const q = new URLSearchParams({ run: '1', ...params });
  await page.goto(`${base}/?${q}`);
  await page.waitForFunction(() => window.les && (window.les.last || window.les.error), null, { timeout, polling: 200 });
  return page.evaluate(() => ({ last: window.les.last, error: window.les.error, progress: window.les.progress, backend: window.les.engine?.backend, status: document.getElementById('status').textContent }));
}
